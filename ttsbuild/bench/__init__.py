"""Open-loop load generation for streaming TTS servers, measuring what a listener hears.

Layout: `schedule` (when to send what), `audio` (decode, audible onset, playback simulation),
`client` (one HTTP or WebSocket request -> a timed trace), `metrics` (trace -> per-request
numbers -> summary), `runner` (the open-loop event loop), `sweep` (one run per rate, table and
plots), `fakeserver` (a scripted in-process server for tests and `bench selftest`), `cli`.
"""
