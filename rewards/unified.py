"""`unifiedscore`: a client for UnifiedReward, a vision-language judge behind an OpenAI-compatible server.

UnifiedReward checkpoints are served by sglang (LLaVA-based v1) or vLLM (Qwen-VL-based 2.0) with a
`/v1/chat/completions` endpoint. Each video is sent as `num_frames` evenly spaced frames (base64 PNG/JPEG
data URLs, longer side resized to `frame_size`) followed by a text prompt built from the condition's caption,
at temperature 0. Two answer formats are supported:

  - "final_score": the judge ends with "Final Score: X", X on a 1-5 scale;
  - "alignment_physics_style" (2.0): "Alignment Score (1-5): X", "Physics Score (1-5): Y",
    "Style Score (1-5): Z"; the reward is the mean of the three.

Normalisation: every 1-5 value X maps to (X - 1) / 4, so 1 -> 0 and 5 -> 1. Peers divide by 5 instead
(1 -> 0.2); the two differ by an affine map, which group-normalised advantages do not see, but (X - 1) / 4
uses the whole [0, 1] range so rewards from different judges mix on a common scale.

Parsing is strict: the value after the last label must be a plain number (digits, optionally a decimal part
after "." or ",") inside 1-5. Markdown around it, "/5", "out of 5", a "(1-5)" note and text after it are read;
another notation ("1e10", "1,000"), another stated scale ("4/10", "4 out of 10", "(1-10)"), a range ("4-5") or
no number at all is a parse failure, as is an answer body over MAX_BODY_BYTES (refused from its Content-Length,
or once that much has arrived, so a runaway server costs at most that much memory) or a compressed one (the
request asks for none: a compressed chunk would decode whole before the cap could count it).

Failures are explicit. A sample whose request failed after all retries, whose answer could not be parsed,
or whose score lies outside 1-5 gets NaN in the score tensor, True in details["failed"], a reason in
details["failure_reason"] and the judge's raw text (if any) in details["raw"]. It is never turned into 0:
a 0 would enter the group statistics as the worst possible video. Parse failures are not retried here, because
at temperature 0 the judge would give the same answer again; the AsyncRewardRunner's "wait" policy re-scores
failed samples (its max_retries rounds) before it excludes them.

Deadline: timeout_s bounds each attempt as a whole (connecting, sending the request and receiving the whole
answer), not each read, so a judge that trickles its answer byte by byte fails the attempt at timeout_s like one
that never answers (rewards/bounded_http.py). Waiting for one of the client's max_concurrency connections is not
counted.

Retries: timeouts, connection errors (including a server closing the socket without answering), HTTP 5xx
and 429 are retried up to `max_retries` times with exponential backoff backoff_s * 2**(attempt - 1)
(a numeric Retry-After header on 429 is honoured, capped at timeout_s). Other 4xx mean the request itself is
wrong (bad model name, payload too large) and are reported at once.

The registered reward is a `UnifiedReward` object built from config.reward.unified by `build_unifiedscore`; it
holds its UnifiedConfig and HTTP client. Building it runs `health_check(config)`, which raises
`UnifiedServerError` naming the URL and the cause when the server cannot be reached, so a run does not discover a
dead judge after its first rollout. UnifiedServerError is a `recam.engine.reward_runner.RewardServerDown` with a
one-line message, so an entry point can report it as such (exit status 3) rather than as a traceback.

A judge that dies mid-run is not an exception here: every request of a batch fails after its retries, so every
score is NaN with a reason. The AsyncRewardRunner turns a batch with no valid sample left after its own retries
into RewardServerDown, and the trainer stops cleanly on it (the last checkpoint is kept as it is).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import re
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

import httpx
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from recam.engine.reward_runner import RewardServerDown
from rewards import bounded_http, register_reward

PROMPT_FORMATS = ("final_score", "alignment_physics_style")
APS_KEYS = ("alignment", "physics", "style")
SCORE_MIN, SCORE_MAX = 1.0, 5.0
# An answer is a few hundred tokens; a body past this is a server gone wrong, and reading it whole could exhaust memory.
MAX_BODY_BYTES = 1 << 20


class UnifiedServerError(RewardServerDown):
    """The UnifiedReward server cannot be used (unreachable, wrong model, bad status).

    A RewardServerDown, so that an entry point handles a judge that is down when the run starts like one that dies
    mid-run: one line naming the URL and the cause, and exit status 3, instead of a traceback. Its message is one
    line."""


class UnifiedParseError(ValueError):
    """The judge's answer does not contain a usable score."""


@dataclass
class UnifiedConfig:
    """Where the judge lives and how to talk to it.

    base_url: server root, e.g. "http://127.0.0.1:30000" (a trailing "/v1" is accepted and ignored).
    model: model name sent in each request (sglang accepts any; vLLM wants the served name).
    api_key_env: environment variable holding the API key; unset or empty means no Authorization header.
    prompt_format: "final_score" or "alignment_physics_style".
    num_frames / frame_size: frames sent per video and the length of their longer side in pixels.
    max_concurrency: requests in flight at once; timeout_s: the overall deadline of one attempt (connect, send,
    whole answer; the wait for a free connection excluded); max_retries: retries after the
    first try; backoff_s: first retry delay, doubled each retry.
    image_format: "png" (lossless) or "jpeg" (smaller requests); max_tokens: answer length cap.
    """

    base_url: str
    model: str
    api_key_env: str = "UNIFIED_API_KEY"
    prompt_format: str = "final_score"
    num_frames: int = 4
    frame_size: int = 64
    max_concurrency: int = 8
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    image_format: str = "png"
    max_tokens: int = 512

    def __post_init__(self):
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if self.image_format not in ("png", "jpeg"):
            raise ValueError(f"image_format must be 'png' or 'jpeg', got {self.image_format!r}")
        for name in ("num_frames", "frame_size", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("max_retries >= 0, timeout_s > 0 and backoff_s >= 0 are required")

    @property
    def api_root(self) -> str:
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root

    @property
    def chat_url(self) -> str:
        return f"{self.api_root}/v1/chat/completions"

    @property
    def models_url(self) -> str:
        return f"{self.api_root}/v1/models"

    def headers(self) -> dict[str, str]:
        key = os.environ.get(self.api_key_env, "")
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class SampleResult:
    """One video's verdict. score is normalised to [0, 1] (NaN when failed); components holds the
    normalised per-aspect scores of the 2.0 format; raw is the judge's text (None if no answer came)."""

    score: float = math.nan
    components: dict[str, float] = field(default_factory=dict)
    raw: str | None = None
    failure: str | None = None
    attempts: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.failure is None


# ----------------------------------------------------------------------------------------------------
# frames


def sample_frame_indices(num_available: int, num_frames: int) -> list[int]:
    """Evenly spaced frame indices including the first and last frame; never more than num_available."""
    if num_available < 1:
        raise ValueError("a video needs at least one frame")
    n = min(num_frames, num_available)
    if n == 1:
        return [0]
    return [round(i * (num_available - 1) / (n - 1)) for i in range(n)]


def video_to_data_urls(video: torch.Tensor, num_frames: int, frame_size: int, image_format: str = "png") -> list[str]:
    """(3, F, H, W) video in [-1, 1] -> data URLs of num_frames evenly spaced frames.

    Frames are resized so that their longer side is frame_size pixels (aspect kept), with antialiasing
    when shrinking so that thin structures do not alias into noise the judge would penalise.
    """
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"video must be (3, F, H, W), got {tuple(video.shape)}")
    _, n_frames, h, w = video.shape
    idx = sample_frame_indices(n_frames, num_frames)
    frames = video.detach().float().cpu()[:, idx].permute(1, 0, 2, 3)  # (n, 3, H, W)
    scale = frame_size / max(h, w)
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    if size != (h, w):
        frames = F.interpolate(frames, size=size, mode="bilinear", align_corners=False, antialias=scale < 1)
    pixels = ((frames.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    mime = "image/png" if image_format == "png" else "image/jpeg"
    urls = []
    for frame in pixels:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(frame)).save(buf, format=image_format.upper())
        urls.append(f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}")
    return urls


# ----------------------------------------------------------------------------------------------------
# prompts and parsing


def build_prompt(caption: str, prompt_format: str, num_frames: int) -> str:
    """The judge's instruction for one video; the answer format it asks for is what the parser reads."""
    intro = (
        f"The images above are {num_frames} frames, in temporal order, sampled from one short AI-generated "
        f"video. The video was generated to show the following description:\n\"{caption}\"\n\n"
    )
    if prompt_format == "final_score":
        return intro + (
            "Judge the video as a whole: how faithfully its content follows the description, how good the "
            "frames look, and whether the objects and the camera move in a smooth, physically plausible and "
            "temporally consistent way across the frames. Give a short justification first. Then finish with "
            "one last line of exactly this form, X being a number from 1 (very poor) to 5 (excellent):\n"
            "Final Score: X"
        )
    if prompt_format == "alignment_physics_style":
        return intro + (
            "Rate three separate aspects of the video, each from 1 (very poor) to 5 (excellent):\n"
            "- Alignment: does the content match the description?\n"
            "- Physics: do objects and the camera move plausibly and consistently from frame to frame, "
            "without flicker, warping or objects appearing and vanishing?\n"
            "- Style: how clean, sharp and visually pleasing are the frames?\n"
            "You may explain briefly, then give the ratings on three lines of exactly this form:\n"
            "Alignment Score (1-5): X\nPhysics Score (1-5): Y\nStyle Score (1-5): Z"
        )
    raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")


# Markdown emphasis / code marks and whitespace the judge may wrap around labels and numbers.
_DECOR = r"[\s*_`#]*"


def _label_pattern(word: str) -> re.Pattern:
    # The bracket after the label ("(1-5)") is kept: a judge that states another scale there is refused.
    return re.compile(rf"{word}[\s*_\-]*score(?:\s*[(\[]([^()\[\]\n]{{0,40}})[)\]])?{_DECOR}[:：=]", re.IGNORECASE)


_FINAL_RE = _label_pattern("final")
_ASPECT_RES = {key: _label_pattern(key) for key in APS_KEYS}
# What follows the label up to the first character that cannot belong to a number: letters, digits, dots and commas
# run together ("1e10", "1,000", "1.5e3", "4th") are judged whole, never by their first digits.
_VALUE_RE = re.compile(rf"{_DECOR}([-+]?[^\W_](?:[^\W_]|[.,]|(?<=[eE])[-+])*)")
_PLAIN_RE = re.compile(r"[0-9]+(?:[.,][0-9]+)?")
_NUM = r"[-+]?[0-9][^\s)\]/*_`;:]*"
_RANGE_SEP = r"\s*(?:-|–|—|~|to)\s*"
_SCALE_LEAD = r"(?:on\s+)?(?:an?\s+|the\s+)?"
# A scale stated right after the value ("4/10", "4 out of 10", "4 (1-10)", "4 on a scale of 1 to 10", "4 on a
# 10-point scale") or inside the label's bracket ("Final Score (1-10):"); each gives the scale's top and maybe bottom.
_SCALE_RES = (
    re.compile(rf"/\s*(?P<high>{_NUM})"),
    re.compile(rf"(?:out\s+)?of\s+(?P<high>{_NUM})", re.IGNORECASE),
    re.compile(rf"{_SCALE_LEAD}(?:scale\s+(?:of|from)\s+)?(?P<low>[0-9][^\s)\]/*_`;:–—~-]*?){_RANGE_SEP}"
               rf"(?P<high>{_NUM})", re.IGNORECASE),
    re.compile(rf"{_SCALE_LEAD}(?P<high>[0-9][0-9.,]*?)[\s-]*point", re.IGNORECASE),
)


def _plain_number(token: str) -> float | None:
    """The value of `token` when it is written as plain digits with an optional decimal part ("4", "3.5", "3,5"),
    else None. A comma followed by exactly three digits ("1,000") groups thousands as often as it marks decimals,
    so it is neither."""
    token = token.rstrip(".,")  # the sentence's own punctuation: "Final Score: 3."
    if not _PLAIN_RE.fullmatch(token) or re.fullmatch(r"[0-9]+,[0-9]{3}", token):
        return None
    return float(token.replace(",", "."))


def _stated_scale(text: str) -> tuple[str | None, str, str] | None:
    """(bottom or None, top, the text after it) of a scale stated at the start of `text`; None when it states
    none."""
    text = re.sub(rf"^{_DECOR}[(\[]?\s*", "", text)
    for pattern in _SCALE_RES:
        m = pattern.match(text)
        if m:
            return m.groupdict().get("low"), m.group("high"), text[m.end():]
    return None


def _check_scale(scale: tuple[str | None, str, str] | None, label: str) -> None:
    if scale is None:
        return
    low, high, _ = scale
    if _plain_number(high) != SCORE_MAX or (low is not None and _plain_number(low) != SCORE_MIN):
        shown = f"{low}-{high}" if low is not None else f"out of {high}"
        raise UnifiedParseError(f"'{label}' given on a scale {shown.rstrip('.,')}, expected the 1-5 scale")


# The rest of the value's line, up to the next label ("... Physics Score: 3" on the same line is that label's).
_NEXT_LABEL_RE = re.compile(r"[^\W\d_]+[\s*_\-]*score\b", re.IGNORECASE)
# Words and signs that make the value a part of something else: a ratio, a percentage, a choice, another scale
# written out ("4 out of ten", "4 %", "3 or 4").
_NOT_ALONE_RE = re.compile(rf"{_DECOR}[(\[]?\s*(?:(?:out\s+of|of|points?|pts|percent|or)\b|[%/／⁄∕÷])", re.IGNORECASE)
_OTHER_SCALE_RE = re.compile(r"\b(?:scale|out\s+of)\b", re.IGNORECASE)


def _check_nothing_else(tail: str, label: str) -> None:
    """The value must stand alone on its line, apart from an accepted 1-5 scale note and prose: another number
    there ("4 — on a 1-10 scale", "3 or 4", "4/5/10") or a ratio word before it ("4 out of ten") leaves the
    score's scale unknown, so it is refused rather than guessed."""
    tail = _NEXT_LABEL_RE.split(tail, maxsplit=1)[0]
    if _NOT_ALONE_RE.match(tail) or _OTHER_SCALE_RE.search(tail):
        raise UnifiedParseError(f"'{label}' is followed by {_short(tail.strip(), 40)!r}: not one score on the "
                                "1-5 scale")
    if re.search(r"\d", tail):  # any script's digits
        raise UnifiedParseError(f"'{label}' has another number after it ({_short(tail.strip(), 40)!r}); "
                                "the 1-5 score must stand alone")


def _read_score(pattern: re.Pattern, text: str, label: str) -> float:
    """The value after the last `label:` in text, on the 1-5 scale; the last one, because judges that reason out
    loud sometimes mention the label before committing to their final value. Only a plain number inside 1-5
    counts: anything else there (another notation, another scale, no number) is a parse failure, never a score,
    and an earlier label's value does not stand in for it."""
    matches = list(pattern.finditer(text))
    if not matches:
        raise UnifiedParseError(f"no '{label}: X' found")
    m = matches[-1]
    if m.group(1) is not None:
        _check_scale(_stated_scale(m.group(1).strip()), label)
    rest = text[m.end():m.end() + 200]
    v = _VALUE_RE.match(rest)
    if v is None:
        raise UnifiedParseError(f"no number after the last '{label}:' ({_short(rest, 40)!r})")
    token = v.group(1)
    value = _plain_number(token)
    if value is None:
        raise UnifiedParseError(f"'{label}' = {_short(token, 40)!r} is not a plain number on the 1-5 scale")
    after = rest[v.end():].split("\n", 1)[0]
    if re.match(rf"{_RANGE_SEP}[0-9]", after):
        raise UnifiedParseError(f"'{label}' is a range ({_short(token + after, 40)!r}), not one score")
    scale = _stated_scale(after)
    _check_scale(scale, label)
    _check_nothing_else(scale[2] if scale else after, label)
    if not SCORE_MIN <= value <= SCORE_MAX:
        raise UnifiedParseError(f"'{label}' = {value:g} outside the 1-5 scale")
    return value


def normalise(value: float) -> float:
    """1-5 -> [0, 1] by (X - 1) / 4."""
    return (value - SCORE_MIN) / (SCORE_MAX - SCORE_MIN)


def parse_answer(text: str, prompt_format: str) -> tuple[float, dict[str, float]]:
    """Judge text -> (normalised score, normalised components). Raises UnifiedParseError when unusable.

    Tolerates case, extra spaces, markdown bold/italics, decimals ("3.5", "3,5"), an explicit "/5" or "out of 5",
    a "(1-5)" scale note and text after the number; refuses every other notation or scale (see _read_score).
    """
    if not isinstance(text, str) or not text.strip():
        raise UnifiedParseError("empty answer")
    if prompt_format == "final_score":
        return normalise(_read_score(_FINAL_RE, text, "Final Score")), {}
    if prompt_format == "alignment_physics_style":
        components, missing = {}, []
        for key, pattern in _ASPECT_RES.items():
            try:
                components[key] = normalise(_read_score(pattern, text, f"{key.capitalize()} Score"))
            except UnifiedParseError as e:
                missing.append(str(e))
        if missing:
            raise UnifiedParseError("; ".join(missing))
        return sum(components.values()) / len(components), components
    raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")


# ----------------------------------------------------------------------------------------------------
# HTTP


def build_payload(video: torch.Tensor, caption: str, config: UnifiedConfig) -> dict:
    """OpenAI chat-completions request body for one video (images first, then the instruction)."""
    urls = video_to_data_urls(video, config.num_frames, config.frame_size, config.image_format)
    content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    content.append({"type": "text", "text": build_prompt(caption, config.prompt_format, len(urls))})
    return {
        "model": config.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": config.max_tokens,
    }


def _retry_after(headers: httpx.Headers, cap: float) -> float:
    try:
        return min(max(float(headers.get("retry-after", "0")), 0.0), cap)
    except ValueError:
        return 0.0


def _short(text: str, n: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


def _post(client: httpx.Client, payload: dict, config: UnifiedConfig) -> tuple[int, httpx.Headers, bytes, str | None]:
    """(status, headers, body, why the body was not read) of one POST, within timeout_s overall and its body read up
    to MAX_BODY_BYTES (rewards/bounded_http.py)."""
    answer = bounded_http.request(client, "POST", config.chat_url, json=payload, headers=config.headers(),
                                  timeout_s=config.timeout_s, max_bytes=MAX_BODY_BYTES)
    return answer.status, answer.headers, answer.body, answer.not_read


def request_score(client: httpx.Client, payload: dict, config: UnifiedConfig) -> SampleResult:
    """POST one payload with retries and parse the answer; every outcome is a SampleResult."""
    t0 = time.monotonic()
    result = SampleResult()
    last_error = "no attempt made"
    extra_wait = 0.0

    def done(failure: str | None = None) -> SampleResult:
        result.failure = failure
        result.seconds = time.monotonic() - t0
        return result

    for attempt in range(config.max_retries + 1):
        if attempt:
            time.sleep(max(config.backoff_s * 2 ** (attempt - 1), extra_wait))
        extra_wait = 0.0
        result.attempts = attempt + 1
        try:
            status, headers, body, too_large = _post(client, payload, config)
        except httpx.TimeoutException as e:
            last_error = f"timeout: no complete answer within {config.timeout_s}s ({type(e).__name__})"
            continue
        except httpx.TransportError as e:  # refused, reset, or closed without a response
            last_error = f"connection error ({type(e).__name__}: {e})"
            continue
        except httpx.DecodingError as e:  # a body whose Content-Encoding does not decode says nothing either
            return done(f"undecodable response body ({e})")
        shown = too_large or _short(body.decode("utf-8", errors="replace"))
        if status == 429 or status >= 500:
            last_error = f"HTTP {status}: {shown}"
            if status == 429:
                extra_wait = _retry_after(headers, config.timeout_s)
            continue
        if status >= 400:
            return done(f"HTTP {status} (not retried): {shown}")
        if too_large:
            return done(too_large)
        try:
            text = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError, RecursionError):
            result.raw = body.decode("utf-8", errors="replace")
            return done(f"malformed response body: {shown}")
        result.raw = text
        try:
            result.score, result.components = parse_answer(text, config.prompt_format)
        except UnifiedParseError as e:
            return done(f"unparseable answer: {e}")
        return done()
    return done(f"gave up after {result.attempts} attempts at {config.chat_url}: {last_error}")


def _caption(condition) -> str:
    return condition if isinstance(condition, str) else condition.caption


class UnifiedClient:
    """Scores batches against one server, at most max_concurrency requests in flight.

    Usable as a context manager; the underlying httpx.Client is thread-safe and pools connections.
    """

    def __init__(self, config: UnifiedConfig):
        self.config = config
        # httpx logs every request at INFO (hundreds of lines in a small run); failures reach the run log anyway
        logging.getLogger("httpx").setLevel(max(logging.getLogger("httpx").level, logging.WARNING))
        self._http = bounded_http.make_client(config.max_concurrency)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> UnifiedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score_videos(self, videos: torch.Tensor, captions: list[str]) -> list[SampleResult]:
        """videos (B, 3, F, H, W) in [-1, 1], B captions -> B results in input order."""
        if videos.ndim != 5 or videos.shape[1] != 3:
            raise ValueError(f"videos must be (B, 3, F, H, W), got {tuple(videos.shape)}")
        if len(captions) != videos.shape[0]:
            raise ValueError(f"{videos.shape[0]} videos but {len(captions)} captions")
        payloads = [build_payload(v, c, self.config) for v, c in zip(videos, captions, strict=True)]
        if not payloads:
            return []
        workers = min(self.config.max_concurrency, len(payloads))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="unified") as pool:
            return list(pool.map(lambda p: request_score(self._http, p, self.config), payloads))

    def score_batch(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
        """Reward-function form: (scores (B,) float32 with NaN where failed, details)."""
        return results_to_reward(self.score_videos(videos, [_caption(c) for c in conditions]),
                                 self.config.prompt_format)


def results_to_reward(results: list[SampleResult], prompt_format: str) -> tuple[torch.Tensor, dict]:
    """B results -> (scores (B,) float32, NaN where failed; details).

    details: raw (list of str | None), failed (B,) bool, failure_reason (list of str | None),
    attempts (B,) int64, seconds (B,) float32 request latency, and for the 2.0 format alignment,
    physics, style (B,) float32 normalised (NaN where failed).
    """
    scores = torch.tensor([r.score if r.ok else math.nan for r in results], dtype=torch.float32)
    details = {
        "raw": [r.raw for r in results],
        "failed": torch.tensor([not r.ok for r in results], dtype=torch.bool),
        "failure_reason": [r.failure for r in results],
        "attempts": torch.tensor([r.attempts for r in results], dtype=torch.int64),
        "seconds": torch.tensor([r.seconds for r in results], dtype=torch.float32),
    }
    if prompt_format == "alignment_physics_style":
        for key in APS_KEYS:
            details[key] = torch.tensor([r.components.get(key, math.nan) if r.ok else math.nan for r in results],
                                        dtype=torch.float32)
    return scores, details


def health_check(config: UnifiedConfig, check_model: bool = True) -> list[str]:
    """Raise UnifiedServerError (naming the URL and the cause) unless the server answers GET /v1/models.

    With check_model, the configured model must be among the served ones (vLLM rejects other names;
    sglang accepts any, so pass check_model=False if its served name differs). Returns the served ids.
    """
    url = config.models_url
    hint = "; start the judge or fix config.reward.unified.base_url"
    try:
        resp = bounded_http.get(url, headers=config.headers(), timeout_s=min(config.timeout_s, 10.0),
                                max_bytes=MAX_BODY_BYTES)
    except httpx.TimeoutException as e:
        raise UnifiedServerError(f"UnifiedReward server at {url} did not answer in time ({type(e).__name__})"
                                 f"{hint}") from e
    except httpx.TransportError as e:
        raise UnifiedServerError(f"UnifiedReward server at {url} is unreachable ({type(e).__name__}: "
                                 f"{_short(str(e))}){hint}") from e
    if resp.status != 200:
        raise UnifiedServerError(f"UnifiedReward server at {url} answered HTTP {resp.status}: "
                                 f"{_short(resp.not_read or resp.text)}")
    try:
        served = [m["id"] for m in json.loads(resp.body)["data"]]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise UnifiedServerError(f"UnifiedReward server at {url} sent an unexpected model list: "
                                 f"{_short(resp.not_read or resp.text)}") from e
    if check_model and config.model not in served:
        raise UnifiedServerError(f"model {config.model!r} is not served at {url}; served: {served}")
    return served


# ----------------------------------------------------------------------------------------------------
# the registered reward


class UnifiedReward:
    """The `unifiedscore` reward object: one judge, its UnifiedConfig and a pooled HTTP client.

    Building it runs health_check (unless check_health=False), so a judge that is down fails where the run builds
    its rewards, before any sampling. Calls are thread-safe: the async reward runner and evaluation share the
    client, and so its max_concurrency connections.
    """

    def __init__(self, config: UnifiedConfig, check_model: bool = True, check_health: bool = True):
        self.served_models = health_check(config, check_model=check_model) if check_health else None
        self.config = config
        self.client = UnifiedClient(config)
        # The trainer has no end-of-run phase that closes rewards: the connections are released by close(), or
        # when this object is collected, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, self.client.close)

    @property
    def server(self) -> str:
        return self.config.api_root

    def describe(self) -> str:
        return f"UnifiedReward judge at {self.config.api_root} is up (serves {self.served_models})"

    def __call__(self, videos: torch.Tensor, conditions: list) -> tuple[torch.Tensor, dict]:
        """(B, 3, F, H, W) in [-1, 1] + B conditions (captions, or objects with .caption) -> (scores (B,) float32
        in [0, 1], NaN where the judge failed after its retries; details as in results_to_reward)."""
        if not self._finalizer.alive:
            raise RuntimeError(f"the unifiedscore reward for {self.config.api_root} was closed")
        return self.client.score_batch(videos, conditions)

    def close(self) -> None:
        self._finalizer()


def unified_config(section) -> UnifiedConfig:
    """UnifiedConfig from a run config's reward.unified section; UnifiedConfig fields the section does not name
    keep their defaults."""
    return UnifiedConfig(**{f.name: section[f.name] for f in fields(UnifiedConfig) if f.name in section})


def check_settings(checks) -> None:
    """The ranges of reward.unified (recam/infra/config_checks.py's FieldChecks)."""
    checks.choice("reward.unified.prompt_format", PROMPT_FORMATS)
    checks.url("reward.unified.base_url")
    checks.nonempty_str("reward.unified.model")
    api_key_env = checks.config.reward.unified.api_key_env
    checks.require(isinstance(api_key_env, str), f"reward.unified.api_key_env must be a string, got {api_key_env!r}")
    for name in ("num_frames", "frame_size", "max_concurrency"):
        checks.integer(f"reward.unified.{name}", 1)
    checks.integer("reward.unified.max_retries", 0)
    checks.number("reward.unified.timeout_s", 0, None, low_open=True)
    checks.boolean("reward.unified.check_model")


@register_reward("unifiedscore", scores="video", check=check_settings)
def build_unifiedscore(config, device=None) -> UnifiedReward:
    """Factory of `unifiedscore`: the judge of config.reward.unified, health-checked now."""
    if config is None:
        raise ValueError("the unifiedscore reward needs a run config: its judge is config.reward.unified "
                         "(base_url, model, ...)")
    section = config.reward.unified
    return UnifiedReward(unified_config(section), check_model=bool(section.get("check_model", True)))

