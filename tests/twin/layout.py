"""The packed sequence's segments and the (t, h, w) position of every row.

The sequence is `[text | condition rows | audio | video]` (t2va / fl2va keyframes) or
`[text | reference blocks | audio | video]` (ref2va). Position rules (float64, as upstream):

- text row i: (i, 0, 0).
- a latent frame of h x w (even) cells is a grid of (h/2) x (w/2) patches whose h and w
  coordinates are normalised by the frame's area: along an axis of `dim` cells,
  ratio = dim / sqrt(h * w) and patch j of n = dim/2 sits at ((1 - ratio)/2 + j * ratio/n) * 32,
  so every canvas spans the same centred range whatever its aspect.
- time: latent frame k of a clip spans 5/3 * (1, 4, 4, 4, 4)[k % 5]; frame k starts at the
  clip's origin plus the spans of frames 0..k-1.
- audio: row r of a stereo clip at origin o is t = o + r for both channels, h = 0, and w at the
  first (left channel) or last (right channel) w coordinate of the frame grid.
- the targets start after the text and the total time span of the reference blocks (image 1,
  audio its length, video max(its audio length, its frame spans)); keyframe rows start at
  origin + 5/3 * their pixel-frame index, on the target's frame grid.

`SequenceLayout` carries what upstream's layout object carries, under the same attribute names
(block-replace patches receive it as args["layout"] and `transformer_options["minimax_h3_layout"]`).
"""

from __future__ import annotations

import math

import torch

from .config import FRAME_GRID_SCALE, FRAMES_PER_LATENT, TIME_STRETCH

F64 = torch.float64


def patch_axis(cells: int, area_side: float) -> torch.Tensor:
    """Area-normalised coordinates of the cells // 2 patches along one axis."""
    span = cells / area_side
    count = cells // 2
    return (torch.arange(count, dtype=F64) * (span / count) + (1.0 - span) / 2.0) * FRAME_GRID_SCALE


def frame_positions(lat_h: int, lat_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([(h/2)*(w/2), 2] (h, w) of one frame's patches, row-major; [w/2] the w axis)."""
    side = math.sqrt(lat_h * lat_w)
    h_axis, w_axis = patch_axis(lat_h, side), patch_axis(lat_w, side)
    grid_h, grid_w = torch.meshgrid(h_axis, w_axis, indexing="ij")
    return torch.stack([grid_h.reshape(-1), grid_w.reshape(-1)], dim=-1), w_axis


def frame_spans(latent_frames: int) -> list[float]:
    return [TIME_STRETCH * FRAMES_PER_LATENT[k % len(FRAMES_PER_LATENT)]
            for k in range(latent_frames)]


def frame_starts(latent_frames: int, origin: float) -> torch.Tensor:
    spans = torch.tensor(frame_spans(latent_frames), dtype=F64)
    before = torch.cat([torch.zeros(1, dtype=F64), spans[:-1].cumsum(0)])
    return float(origin) + before


def video_positions(latent_frames: int, frame: torch.Tensor, origin: float) -> torch.Tensor:
    out = torch.empty(latent_frames, frame.shape[0], 3, dtype=F64)
    out[:, :, 0] = frame_starts(latent_frames, origin)[:, None]
    out[:, :, 1:] = frame[None]
    return out.reshape(-1, 3)


def audio_positions(origin: float, steps: int, w_left: float, w_right: float) -> torch.Tensor:
    out = torch.zeros(2 * steps, 3, dtype=F64)
    out[:, 0] = (origin + torch.arange(steps, dtype=F64)).repeat(2)
    out[:steps, 2] = w_left
    out[steps:, 2] = w_right
    return out


def reference_span(ref: dict) -> float:
    """Time-axis length a reference block occupies before the targets."""
    kind = ref["kind"]
    if kind == "image":
        return 1.0
    if kind == "audio":
        return float(ref["ref_audio_t"])
    if kind in ("video", "video_audio"):
        return max(float(ref["ref_audio_t"]), sum(frame_spans(ref["latent_t"])))
    return 0.0


class SequenceLayout:
    """Segments `(start, stop, kind)` and positions `[S, 3]` of one packed sequence.

    kinds: text, cond, cond_audio (keyframes), ref_img, ref_audio (references), audio, video
    (the targets, always the last two). `img_update` / `audio_update` mark, over all video-like
    / audio-like rows in sequence order, which rows are the targets' (True) and which are
    condition rows (False). `signature` is the shape key a cached layout is checked against.
    """

    def __init__(self, text_len: int, latent_t: int, lat_h: int, lat_w: int, audio_t: int,
                 keyframes: list[dict] | None = None, refs: list[dict] | None = None):
        frame, w_axis = frame_positions(lat_h, lat_w)
        stereo_w = (float(w_axis[0]), float(w_axis[-1]))
        self._kinds: list[tuple[str, int]] = []
        self._positions: list[torch.Tensor] = []
        self._image_rows: list[bool] = []
        self._audio_rows: list[bool] = []

        text = torch.zeros(text_len, 3, dtype=F64)
        text[:, 0] = torch.arange(text_len, dtype=F64)
        self._add("text", text)

        origin = float(text_len)
        for ref in refs or ():
            origin += reference_span(ref)
        for keyframe in keyframes or ():
            at = origin + TIME_STRETCH * keyframe["resolved_frame_index"]
            if keyframe.get("latent") is not None:
                frames = keyframe["latent"].shape[2]
                self._add("cond", video_positions(frames, frame, at))
            if keyframe.get("audio_latent") is not None:
                self._add("cond_audio", audio_positions(at, keyframe["audio_latent"].shape[-1],
                                                        *stereo_w))
        cursor = float(text_len)
        for ref in refs or ():
            cursor = self._add_reference(ref, cursor, stereo_w)

        self._add("audio", audio_positions(origin, audio_t, *stereo_w))
        self._add("video", video_positions(latent_t, frame, origin))

        self.segments: list[tuple[int, int, str]] = []
        start = 0
        for kind, rows in self._kinds:
            self.segments.append((start, start + rows, kind))
            start += rows
        self.seq_len = start
        self.position_ids = torch.cat(self._positions)
        self.img_update = torch.tensor(self._image_rows, dtype=torch.bool)
        self.audio_update = torch.tensor(self._audio_rows, dtype=torch.bool)
        self.img_pos = self._rows_of(("cond", "ref_img", "video"))
        self.audio_pos = self._rows_of(("cond_audio", "ref_audio", "audio"))
        self.signature = (text_len, latent_t, lat_h, lat_w, audio_t)

    def _add(self, kind: str, positions: torch.Tensor) -> None:
        rows = positions.shape[0]
        self._kinds.append((kind, rows))
        self._positions.append(positions)
        if kind in ("cond", "ref_img", "video"):
            self._image_rows += [kind == "video"] * rows
        elif kind in ("cond_audio", "ref_audio", "audio"):
            self._audio_rows += [kind == "audio"] * rows

    def _add_reference(self, ref: dict, cursor: float, stereo_w: tuple[float, float]) -> float:
        kind = ref["kind"]
        if kind == "image":
            frame, _ = frame_positions(ref["latent_h"], ref["latent_w"])
            rows = torch.empty(frame.shape[0], 3, dtype=F64)
            rows[:, 0] = cursor
            rows[:, 1:] = frame
            self._add("ref_img", rows)
            return cursor + 1.0
        if kind == "audio":
            steps = ref["ref_audio_t"]
            if steps > 0:
                self._add("ref_audio", audio_positions(cursor, steps, *stereo_w))
            return cursor + float(steps)
        if kind in ("video", "video_audio"):
            steps, frames = ref["ref_audio_t"], ref["latent_t"]
            frame, w_axis = frame_positions(ref["latent_h"], ref["latent_w"])
            if steps > 0:  # the block's audio rows go right before its frames, same origin
                self._add("ref_audio", audio_positions(cursor, steps, float(w_axis[0]),
                                                       float(w_axis[-1])))
            self._add("ref_img", video_positions(frames, frame, cursor))
            return cursor + max(float(steps), sum(frame_spans(frames)))
        return cursor

    def _rows_of(self, kinds: tuple[str, ...]) -> torch.Tensor:
        parts = [torch.arange(a, b) for a, b, kind in self.segments if kind in kinds]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def span(self, kind: str) -> tuple[int, int]:
        """(start, stop) of the first segment of `kind`."""
        return next((a, b) for a, b, k in self.segments if k == kind)
