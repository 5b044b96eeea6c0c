"""Every serving knob in one place, with its default and why.

A profile fixes the chunk schedule (frames per audio chunk, ramping up so the first chunk is
small and later chunks amortise the codec) and the scheduler's deadline margins. Unlike a
captured-graph server the eager engine has no per-shape cost, so a profile is only policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

FRAME_SAMPLES = 1920  # 80 ms of 24 kHz audio per codec frame
SAMPLE_RATE = 24_000
FRAME_S = FRAME_SAMPLES / SAMPLE_RATE


class ProfileName(StrEnum):
    low_latency = "low-latency"
    balanced = "balanced"
    throughput = "throughput"


@dataclass(frozen=True)
class Profile:
    name: ProfileName
    chunk_schedule: tuple[int, ...]  # frames per chunk; the last entry repeats
    urgent_slack_s: float  # a stream whose slack falls below this anchors the next batch
    soon_slack_s: float  # ...below this it goes before round-robin work
    safety_margin_s: float  # deadline = playback start + audio sent - this
    # The longest a new request may wait for an engine slot once a queue stands (overload;
    # SchedulerConfig.overload_wait_s unless set there): one expected to wait longer is refused
    # (429) at once, one queued longer is refused then.
    overload_wait_s: float = 2.0


# low-latency's ramp starts with two one-frame chunks: with [1, 2, 4, 8, 12] every underrun at
# 40 req/s on the H200 was the second chunk (two frames to make and decode within the first
# chunk's 80 ms); with [1, 1, 2, 4, 8, 12] 1 underrun request against 11, 0 refusals against 4,
# p95 first audio 39.6 against 44.0 ms, for 8 % more codec steps
# (benchmarks/serve/2026-12-02-h200-ramp-ab).
# low-latency's wait for a slot under overload: there that wait is first-audio latency. On
# the H200 no request was held over 30 ms between arrival and admission at 85 req/s or below
# (benchmarks/serve/2026-12-03-h200-lane-off: tts_first_audio_phase_seconds{phase="admit"});
# at 100 req/s on 256 slots 4,600 of 11,000 waited over 0.2 s (2026-12-03-h200-256-slots).
# The CPU model at 170 req/s (2x the 85 measured), 128 slots: p95 first audio 1.7 s with 2 s
# of queueing, 70-75 ms with 0.02 s once a queue stands, and 100 req/s still refuses nothing
# (benchmarks/serve/2026-12-03-cpu-shared-gpu-model). On the H200 at 200 req/s with 256 slots
# a queue stood once, as the load met an idle server, and the capacity check refused the rest
# of the minute at once (2026-12-03-h200-capacity-256).
LOW_LATENCY_OVERLOAD_WAIT_S = 0.02
PROFILES = {
    ProfileName.low_latency: Profile(ProfileName.low_latency, (1, 1, 2, 4, 8, 12), 0.025, 1.0,
                                     0.05, LOW_LATENCY_OVERLOAD_WAIT_S),
    ProfileName.balanced: Profile(ProfileName.balanced, (4, 4, 8, 16, 25), 0.05, 1.0, 0.1, 0.5),
    ProfileName.throughput: Profile(ProfileName.throughput, (25,), 0.1, 2.0, 0.2),
}

# OpenAI's voice names -> the CustomVoice speakers (every Qwen3-TTS CustomVoice checkpoint has
# these nine), so unmodified OpenAI clients (default voices: alloy, ash) work. Chosen by the
# voices' character: female OpenAI voices on serena / vivian / ono_anna / sohee, male ones on
# ryan / aiden (the native English speakers) and eric / dylan. `--voice-alias` replaces it.
DEFAULT_VOICE_ALIASES = {
    "alloy": "serena",
    "ash": "ryan",
    "ballad": "aiden",
    "cedar": "ryan",
    "coral": "vivian",
    "echo": "aiden",
    "fable": "eric",
    "marin": "serena",
    "nova": "vivian",
    "onyx": "dylan",
    "sage": "ono_anna",
    "shimmer": "sohee",
    "verse": "aiden",
}

MAX_CHUNK_FRAMES = 48  # below the GPU engine's per-slot codec ring (64), bootstrap frame included


@dataclass(frozen=True)
class SchedulerConfig:
    profile: Profile = PROFILES[ProfileName.low_latency]
    num_slots: int = 8  # engine slots (requests generating at once)
    max_queue: int = 64  # requests waiting for a slot; one more is answered 429 at once
    # Waiting for a slot (see scheduler.py): a request that gets none within queue_timeout_s
    # is answered 429, and within overload_wait_s (None: the profile's) once a queue stands:
    # its head was seen waiting longer than that throughout standing_queue_s, and it stands
    # until nothing was refused for as long. A burst queues; overload is refused quickly. One
    # expected to wait longer than it may, as the slots freed over the last release_window_s
    # tell, is answered 429 at once (refuse_long_waits; False: it queues until its wait is
    # up).
    queue_timeout_s: float = 2.0
    overload_wait_s: float | None = None
    standing_queue_s: float = 0.5
    release_window_s: float = 2.0
    refuse_long_waits: bool = True
    max_batch: int = 64  # rows per stage call (the engine's slots bound it too)
    max_buffered_s: float = 120.0  # audio produced but not yet sent, all streams: above it 503
    stream_buffer_s: float = 20.0  # one stream's unsent audio above this pauses its generation
    cost_ema: float = 0.2  # weight of the newest stage timing in the running estimate
    # Admission by measured capacity (see scheduler.py): a new stream is refused at once (429)
    # when an admitted stream is behind its playback or the streams' demand would exceed the
    # real-time streams the engine sustains, as measured over the window, / (1 + margin).
    admit_by_capacity: bool = True
    capacity_window_s: float = 1.0
    capacity_margin: float = 0.5  # 0.3 let ramping streams run late at 2x overload (fake clock)
    # ...and refused while an admitted stream's latest chunk came less than this before its
    # playback needed it (0: only once one came late). Throughput is not what runs out first
    # on a GPU: at 60 req/s on the H200 streams were generated ~4x faster than real time
    # (rtf p50 0.27) while 7 % of them underran at their second chunk: the frame and codec
    # steps it waits for came 2-3x further apart than their microbenchmark times, sharing the
    # GPU (benchmarks/serve/2026-12-02-h200-capacity-128).
    admit_slack_s: float = 0.0
    # ...and at least this while requests are being refused (one was in the last
    # standing_queue_s, other than by this slack alone: its own refusals do not keep it on,
    # or one stray refusal at moderate load would): under overload admitted streams keep a
    # margin; below it admission is as without (a rate with refusals fails the bench's
    # capacity rule anyway).
    # The H200 showed the slack protects under overload and costs refusals below it
    # (admit_slack_s above). At 200 req/s (2x the 100 measured on 256 slots) on the H200,
    # side by side: 0.12 s left 0 underrun requests among 4,142 admitted (p95 first audio
    # 79.8 ms), 0.06 s left 7 and 9 among ~6,040 (94.3 / 99.4 ms) in two runs
    # (benchmarks/serve/2026-12-03-h200-capacity-256). The price: ~30 % fewer admitted under
    # overload. Below capacity it stays off (100 req/s refused nothing with 0.06 s).
    overload_slack_s: float = 0.12
    # While requests are being refused (as for overload_slack_s), admit new streams no faster
    # than this many times the rate slots were freed over release_window_s (plus one): the
    # streams generating stay as many as they are, and a burst of arrivals does not become
    # a burst of new streams whose second chunks all wait behind each other. 0: off.
    # The CPU model at 200 req/s (256 slots, overload slack 0.06, 5 runs of 20 s): 24 late
    # streams against 10 with 1.0, 10,208 admitted against 10,179; with the slack at 0.12:
    # 17 against 11 (benchmarks/serve/2026-12-03-cpu-shared-gpu-model). Not yet run on the
    # H200 (whose underruns at 0.06 / 0.12 were 7-9 / 0 a minute): off.
    overload_admit_rate: float = 0.0
    # Codec steps launched and not yet read back, at most (first chunks excepted): one more
    # waits for a turn after the oldest is read, gathering more rows, instead of queueing on
    # the codec stream behind them (a pipelined engine; a serial one has at most one).
    # 3 with batched prefill: at 70 req/s on the H200 4 refused and 3 underrun requests a
    # minute against 40 and 32 with 2 and one prompt per prefill step
    # (benchmarks/serve/2026-12-03-h200-batched-prefill-ab).
    max_audio_in_flight: int = 3
    # A stream's first chunks whose codec steps the engine's admission lane runs (one-frame
    # chunks only; the first always): excepted from max_audio_in_flight and launched in the
    # loop's first-audio turn, beside the regular codec lane's steps. 1: the first chunk only.
    # serve sets the engine's GraphBackend.lane_codec_steps to match (--lane-chunks).
    lane_chunks: int = 1
    # The engine's admission lane takes new streams only while fewer than this many streams
    # hold slots; from there on, until fewer than three quarters of it do, new streams take the
    # regular steps (prefill fenced with them, first frame in the next frame step, first codec
    # step in a regular one) and express admission pauses. 0: the lane whenever the engine has
    # one. The lane's one-row steps buy first audio at low load and cost throughput at high
    # load. H200, lane off throughout: 0 refused and 0 underrun requests at 70 and 85 req/s
    # (p95 first audio 49.6 / 61.4 ms) against 3 / 1 at 70 and 102 / 45 at 85 with it
    # (benchmarks/serve/2026-12-03-h200-lane-off); with it at 1-40 req/s p95 12.5-22.4 ms,
    # where 40 req/s holds 30 streams on average, 43 at p95 (2026-12-03-h200-new-defaults).
    lane_max_active: int = 48
    # A new stream's first frames the engine's admission lane makes (its plan's lane_frames;
    # serve sets it): with 2, a first chunk of two frames gets its second frame in the loop's
    # express turn right after the first, on that lane.
    lane_frames: int = 1
    # A codec step decodes each row's next chunk exactly (its schedule size), leaving frames
    # made past it (a frame step in flight when the chunk's frames were complete) for the next
    # chunk; off: a row decodes every frame it has, and a chunk of 4 with one more is two codec
    # launches (4 + 1). serve --exact-chunks; tts_codec_launches_per_step shows which pays.
    exact_chunks: bool = False
    # A codec step's frames, at most (0: no bound; the anchor's row always goes): rows join in
    # urgency order while their frames fit, so a step that carries a chunk due soon is not
    # also decoding the 8- and 12-frame chunks of streams seconds ahead of their playback. A
    # codec step costs about its frames (unlike a frame step, whose rows are nearly free):
    # at 70 req/s on the H200 steps of 17-64 streams' chunks took 20-45 ms beside the frame
    # steps, and a stream's second chunk, due 80 ms after its first, waited for them
    # (benchmarks/serve/2026-12-03-h200-stalls). Served at 70 req/s on 256 slots, 96 made 0
    # underrun requests against 33, but smaller steps made less audio per GPU second and the
    # capacity admission refused 992 requests against 54 (p95 first audio 146 ms):
    # benchmarks/serve/2026-12-03-h200-codec-budget-ab. Off. serve --codec-step-frames.
    codec_step_frames: int = 0
    # Paced frame steps (0: off, every turn steps every ready stream): a frame step runs only
    # when a stream needs one, i.e. a new stream waits for its first audio or a stream's slack
    # (seconds before its client's buffer runs dry, the next chunk's making counted) is below
    # this; every ready stream rides along. Streams then make audio at the rate deadlines
    # need (the ramp's 2x real time, not the ~10x of back-to-back steps), so more of them are
    # generating at once and each step carries more rows: the GPU's fixed cost per step is
    # spread over more frames. Needs slots (and batch buckets) for the extra streams.
    pace_slack_s: float = 0.0

    @property
    def overload_wait(self) -> float:
        """The wait for a slot once a queue stands: overload_wait_s, else the profile's."""
        return self.profile.overload_wait_s if self.overload_wait_s is None \
            else self.overload_wait_s  # fmt: skip


@dataclass(frozen=True)
class ServeConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_body_bytes: int = 64 * 1024  # HTTP body and WebSocket message limit (413 / error)
    drop_bootstrap_frame: bool | None = None  # None: drop for real checkpoints, keep stand-ins
    trim_onset: bool = False  # also trim leading near-silence (real checkpoints only)
    onset_dbfs: float = -45.0
    warmup_text: str = "Warm up."
    ws_max_text_chars: int = 64 * 1024  # whole WebSocket session
    ws_flush_after_s: float = 0.3  # input stalled this long: synthesize what we have
    model_name: str = "qwen3-tts"
    # Base checkpoints: where registered voices live (None: in memory, lost at exit).
    voices_dir: str | None = None
    # OpenAI voice name -> model speaker; None: DEFAULT_VOICE_ALIASES, less any speaker the
    # model lacks. A map given here must name only the model's speakers (checked at startup).
    voice_aliases: dict[str, str] | None = None
    encode_workers: int = 2  # threads running the mp3/opus/aac/flac/G.711 encoders
    # An engine whose admission lane runs beside other steps (a GPU): admit an arrival while
    # the loop waits for a frame step, and launch a first codec step right behind its first
    # frame (serve.loop.EngineLoop express). False: every arrival waits for the next turn.
    express_admission: bool = True
    # After the warm-up, move the startup objects out of the cyclic GC's reach (gc.freeze):
    # a full collection of them stops every thread for ~0.1-0.2 s (serve.service).
    gc_freeze: bool = True
    # ...and collect generation 0 once this many more tracked objects were made than freed
    # (the interpreter's 700; generations 1 and 2 as given). Serving makes no cyclic garbage
    # (benchmarks/serve/gc_load.py: every collection found none), so at 700 each collection
    # only scans the live requests' objects: over HTTP at 8 req/s on a CPU 98 pauses a minute,
    # 0 at 10 000, tracked objects the same after the load. On the H200 at 70 req/s: 4-5
    # gen-0 pauses a minute and no gen-1/gen-2 ones, against ~450 / ~40 / 3 at 700
    # (benchmarks/serve/2026-12-03-h200-lane-frames-ab). None: the interpreter's.
    gc_threshold: tuple[int, int, int] | None = (10_000, 10, 10)
