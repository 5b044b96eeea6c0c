"""Checkpoint handling: the official layout (schema), conversion, stand-ins, loading.

Submodules: `schema` (official tensor layout from configs), `convert` (`convert_checkpoint`),
`init_random` (stand-ins), `checkpoint` (`load_checkpoint`), `cli` (typer commands).
Nothing is imported here, so `ttsbuild --help` does not pay for torch.
"""
