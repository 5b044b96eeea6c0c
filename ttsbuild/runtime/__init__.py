"""Loading models and running synthesis: the slot-based engine API the server drives."""
