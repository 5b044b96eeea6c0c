"""`ttsbuild serve`: one deadline-aware scheduler over the engine's stages, behind
OpenAI-compatible streaming HTTP and a WebSocket text-in/audio-out protocol.

config.py     every knob with its default (profiles: chunk schedules and margins)
scheduler.py  pure-Python policy: plan -> (engine executes) -> commit; clock injected
loop.py       the engine thread (plan, execute, commit) and the bridge to asyncio
audio.py      PCM16, WAV headers, the bootstrap-frame / onset trimmer
segmenter.py  live text -> synthesis segments (WebSocket)
schema.py     strict request validation at the edge, OpenAI-style error bodies
app.py        FastAPI routes (HTTP, WebSocket, voices, health, ready, metrics)
metrics.py    Prometheus collectors on a per-app registry
cli.py        the `serve` typer command
"""
