"""Caffe's WindowData layer (R-CNN fine-tuning) and its geometry: reading a window file, and
where a window with its context lands in the warped crop (``warp_box``, Caffe's arithmetic in
float32 with C's rounding)."""
from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from ..blob import Blob
from ..layers.base import register
from .datum import DataError, decode_image, resize_bilinear
from .layers import PendingBatch, StreamDataLayer
from .transformer import read_mean_file



class WindowImage(NamedTuple):
    """One image record of a window file; ``windows`` rows are (class, overlap, x1, y1, x2, y2,
    line), coordinates inclusive and 0-based as Caffe reads them."""
    name: str
    channels: int
    height: int
    width: int
    windows: list[tuple[int, float, int, int, int, int, int]]


def _tokens(text: str) -> Iterator[tuple[str, int]]:
    for n, line in enumerate(text.splitlines(), 1):
        for token in line.split():
            yield token, n


def read_window_file(path: Path) -> list[WindowImage]:
    """Parse Caffe's window file (R-CNN's format), one image record after another::

        # <image index>
        <image path>
        <channels>
        <height>
        <width>
        <number of windows>
        <class> <overlap> <x1> <y1> <x2> <y2>     (one line per window)

    Like Caffe's stream reader, any whitespace separates the fields (image paths cannot hold
    spaces). Caffe uses the image index to look the image up by file order, so the indices
    must run 0, 1, 2, ...; anything else is reported as an error rather than read as the wrong
    picture. Errors are one DataError naming the file and line.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise DataError(f"cannot read window file {path}: {e.strerror}") from None
    tokens = _tokens(text)
    last_line = max(1, len(text.splitlines()))

    def take(what: str, kind: Callable[[str], Any] = str, check: str = "") -> tuple[Any, int]:
        try:
            token, n = next(tokens)
        except StopIteration:
            raise DataError(f"{path}:{last_line}: unexpected end of file, "
                            f"expected {what}") from None
        try:
            value = kind(token)
        except ValueError:
            raise DataError(f"{path}:{n}: expected {what}, got {token!r}") from None
        if (check == "positive" and value <= 0) or (check == "non-negative" and value < 0):
            raise DataError(f"{path}:{n}: {what} must be {check}, got {token!r}")
        return value, n

    images: list[WindowImage] = []
    while True:
        try:
            tag, n = next(tokens)
        except StopIteration:
            break
        if tag != "#":
            raise DataError(f"{path}:{n}: expected '# <image index>' to start image record "
                            f"{len(images)}, got {tag!r}")
        index, n = take("the image index after '#'", int)
        if index != len(images):
            raise DataError(f"{path}:{n}: image index {index} out of sequence, expected "
                            f"{len(images)} (Caffe finds an image by its index in file order)")
        name, _ = take("the image path")
        channels, n = take("the number of channels", int, "positive")
        if channels not in (1, 3):
            raise DataError(f"{path}:{n}: images must have 1 or 3 channels, got {channels}")
        height, _ = take("the image height", int, "positive")
        width, _ = take("the image width", int, "positive")
        count, _ = take("the number of windows", int, "non-negative")
        windows = []
        for _ in range(count):
            what = "a window line '<class> <overlap> <x1> <y1> <x2> <y2>'"
            label, n = take(what, int)
            overlap, _ = take(what, float)
            x1, _ = take(what, int)
            y1, _ = take(what, int)
            x2, _ = take(what, int)
            y2, n2 = take(what, int)
            if x2 < x1 or y2 < y1:
                raise DataError(f"{path}:{n2}: window ({x1}, {y1}, {x2}, {y2}) has x2 < x1 or "
                                f"y2 < y1 (corners are inclusive: x1 y1 x2 y2)")
            windows.append((label, overlap, x1, y1, x2, y2, n))
        images.append(WindowImage(name, channels, height, width, windows))
    if not images:
        raise DataError(f"window file {path} is empty")
    return images


def _c_round(value: np.float32) -> int:
    """C's round(): halves away from zero (NumPy's round goes to even). Exact: a float32
    plus 0.5 is representable in float64."""
    x = float(value)
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


class WarpBox(NamedTuple):
    """Where one window comes from and where its warped pixels land in the crop."""
    x1: int  # source region in the image, inclusive
    y1: int
    x2: int
    y2: int
    out_h: int  # size the region is warped to
    out_w: int
    pad_h: int  # offset of the warped region in the crop_size x crop_size output
    pad_w: int


def warp_box(box: tuple[int, int, int, int], image_hw: tuple[int, int], crop: int,
             context_pad: int, square: bool, mirror: bool) -> WarpBox:
    """Caffe's window geometry (window_data_layer.cpp): with context padding or square mode
    the box is grown about its centre so that, warped to ``crop``, ``context_pad`` pixels of
    context surround it; the grown box is clipped to the image and the clipped part keeps the
    scale of the unclipped one, so the crop is zero where the box left the image.

    The arithmetic is float32 with C rounding, as in Caffe's float nets, so crops match pixel
    for pixel. Raises DataError when no part of the box lies in the image.
    """
    x1, y1, x2, y2 = box
    img_h, img_w = image_hw
    if not (context_pad > 0 or square):
        if x1 < 0 or y1 < 0 or x2 >= img_w or y2 >= img_h:
            raise DataError(f"window ({x1}, {y1}, {x2}, {y2}) does not fit in the "
                            f"{img_w}x{img_h} (width x height) image")
        return WarpBox(x1, y1, x2, y2, crop, crop, 0, 0)
    f32 = np.float32
    context_scale = f32(crop) / f32(crop - 2 * context_pad)
    half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
    centre_x, centre_y = f32(x1) + half_w, f32(y1) + half_h
    if square:
        half_h = half_w = max(half_h, half_w)
    x1 = _c_round(centre_x - half_w * context_scale)
    x2 = _c_round(centre_x + half_w * context_scale)
    y1 = _c_round(centre_y - half_h * context_scale)
    y2 = _c_round(centre_y + half_h * context_scale)
    unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
    pad_x2, pad_y2 = max(0, x2 - img_w + 1), max(0, y2 - img_h + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    if x1 > x2 or y1 > y2:
        raise DataError(f"window ({box[0]}, {box[1]}, {box[2]}, {box[3]}) lies outside the "
                        f"{img_w}x{img_h} (width x height) image")
    scale_x, scale_y = f32(crop) / f32(unclipped_w), f32(crop) / f32(unclipped_h)
    out_w = _c_round(f32(x2 - x1 + 1) * scale_x)
    out_h = _c_round(f32(y2 - y1 + 1) * scale_y)
    pad_h = _c_round(f32(pad_y1) * scale_y)
    # a mirrored crop is flipped after warping, so its left padding is the box's right one
    pad_w = _c_round(f32(pad_x2 if mirror else pad_x1) * scale_x)
    # rounding can push the warped region past the crop's edge
    out_h, out_w = min(out_h, crop - pad_h), min(out_w, crop - pad_w)
    return WarpBox(x1, y1, x2, y2, out_h, out_w, pad_h, pad_w)


@register("WindowData", "WINDOW_DATA")
class WindowDataLayer(StreamDataLayer):
    """Caffe's WindowData layer (R-CNN fine-tuning): each item is a window sampled from a
    window file, cut out of its image with optional context and warped to crop_size.

    Every batch holds ``B - int(B * fg_fraction)`` background windows (overlap below
    bg_threshold; label 0) followed by ``int(B * fg_fraction)`` foreground ones (overlap at
    least fg_threshold; their class), each drawn uniformly from its set, then mirrored at
    random when ``mirror`` is set; windows in between the thresholds are never used. Item
    ``k`` of the stream draws from a Generator seeded by (layer seed, k), so a batch is a
    pure function of its position (exact resume, prefetch) like the other data layers; as
    the foreground/background split is per batch, P workers with batch B do not see what one
    worker with batch P*B would, only different windows each.

    Pixels are ``(pixel - mean) * scale`` where the warped window lands; the context that
    falls outside the image stays 0. The mean is ``mean_value`` per channel, or the mean
    file's centre crop_size x crop_size square (Caffe offsets both axes by
    ``(mean_width - crop_size) // 2``). crop_size, mirror, scale and mean_file are read from
    transform_param or window_data_param (a V1 net's upgrade moves them to transform_param;
    Caffe reads ``scale`` from window_data_param only). Images are decoded with Pillow into
    BGR (or grey when the window file gives 1 channel) and warped with OpenCV's bilinear rule.
    """

    exact_num_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        wp = self.param.window_data_param
        if not wp.source:
            raise self.fail("window_data_param.source is not set")
        self.source = self.context.resolve(wp.source)
        with self._named_errors():
            images = read_window_file(self.source)
        channels = {im.channels for im in images}
        if len(channels) > 1:
            raise self.fail(f"{self.source}: images with different numbers of channels "
                            f"({sorted(channels)}); one batch holds one kind")
        self.channels = channels.pop()
        self.crop_size = int(self._setting("crop_size"))
        if self.crop_size <= 0:
            raise self.fail("crop_size must be set: every window is warped to "
                            "crop_size x crop_size")
        self.context_pad = int(wp.context_pad)
        if 2 * self.context_pad >= self.crop_size:
            raise self.fail(f"context_pad {self.context_pad} leaves no room for the window in "
                            f"crop_size {self.crop_size}")
        if wp.crop_mode not in ("warp", "square"):
            raise self.fail(f"crop_mode must be \"warp\" or \"square\", got {wp.crop_mode!r}")
        self.square = wp.crop_mode == "square"
        self.mirror = bool(self._setting("mirror"))
        self.scale = np.float32(self._setting("scale"))
        self.mean = self._mean()
        self.image_paths = [self.context.resolve(wp.root_folder + im.name) for im in images]
        self.fg, self.bg = self._split(images, np.float32(wp.fg_threshold),
                                       np.float32(wp.bg_threshold))
        self._init_stream(wp.batch_size, 0, strided=True, prefetch=self.param.data_param.prefetch)
        self._init_decoders()
        self.num_fg = int(np.float32(self.batch_size) * np.float32(wp.fg_fraction))
        self.num_bg = self.batch_size - self.num_fg
        for pool, n, kind, rule in ((self.fg, self.num_fg, "foreground", f"overlap >= "
                                     f"fg_threshold {wp.fg_threshold:g}"),
                                    (self.bg, self.num_bg, "background", f"overlap < "
                                     f"bg_threshold {wp.bg_threshold:g}")):
            if n and not len(pool):
                raise self.fail(f"{self.source} has no {kind} windows ({rule}) but each batch "
                                f"takes {n}")
        # Caffe keeps the files' bytes and decodes them per window; so do we
        self._cache: list[bytes] | None = (
            [self._read_bytes(i) for i in range(len(images))] if wp.cache_images else None)
        self._seed = self._draw_seed()
        self._shape_tops(top, [(self.batch_size, self.channels, self.crop_size, self.crop_size),
                               (self.batch_size,)])

    def _setting(self, field: str) -> float | bool | str:
        """A field that transform_param and window_data_param both have: whichever is set."""
        tp, wp = self.param.transform_param, self.param.window_data_param
        if tp.HasField(field) and wp.HasField(field) and getattr(tp, field) != getattr(wp, field):
            raise self.fail(f"transform_param.{field} and window_data_param.{field} differ; "
                            f"set one")
        return getattr(tp if tp.HasField(field) else wp, field)

    def _mean(self) -> np.ndarray | None:
        """The value to subtract at each output position, (C, crop, crop), or None."""
        c, crop = self.channels, self.crop_size
        values = np.asarray(self.param.transform_param.mean_value, dtype=np.float32)
        mean_file = self._setting("mean_file")
        if mean_file and len(values):
            raise self.fail("cannot specify mean_file and mean_value at the same time")
        if len(values):
            if len(values) not in (1, c):
                raise self.fail(f"specify either 1 mean_value or as many as channels ({c}), "
                                f"got {len(values)}")
            return np.ascontiguousarray(np.broadcast_to(
                np.broadcast_to(values, (c,)).reshape(c, 1, 1), (c, crop, crop)))
        if not mean_file:
            return None
        path = self.context.resolve(str(mean_file))
        with self._named_errors():
            mean = read_mean_file(path)
        off = (mean.shape[2] - crop) // 2
        if mean.shape[0] != c or off < 0 or off + crop > mean.shape[1]:
            raise self.fail(f"mean file {path} has shape {mean.shape}; WindowData needs "
                            f"({c}, H, W) with W >= crop_size {crop} and room for a "
                            f"{crop}x{crop} square at ({off}, {off})")
        return np.ascontiguousarray(mean[:, off:off + crop, off:off + crop])

    def _split(self, images: list[WindowImage], fg_threshold: np.float32,
               bg_threshold: np.float32) -> tuple[np.ndarray, np.ndarray]:
        """Foreground and background windows as rows (image, label, x1, y1, x2, y2, line)."""
        fg, bg = [], []
        for i, im in enumerate(images):
            for label, overlap, x1, y1, x2, y2, line in im.windows:
                overlap = np.float32(overlap)  # Caffe compares in float
                if overlap >= fg_threshold:
                    if label <= 0:
                        raise self.fail(f"{self.source}:{line}: a foreground window (overlap "
                                        f"{overlap:g} >= fg_threshold) needs a class > 0, "
                                        f"got {label}")
                    fg.append((i, label, x1, y1, x2, y2, line))
                elif overlap < bg_threshold:
                    bg.append((i, 0, x1, y1, x2, y2, line))
        return (np.array(fg, dtype=np.int64).reshape(-1, 7),
                np.array(bg, dtype=np.int64).reshape(-1, 7))

    def _read_bytes(self, image: int) -> bytes:
        path = self.image_paths[image]
        try:
            return path.read_bytes()
        except OSError as e:
            raise self.fail(f"cannot read image {path} (image {image} of {self.source}): "
                            f"{e.strerror}") from None

    def _image(self, image: int) -> np.ndarray:
        """The image as HWC uint8 (BGR, or one grey channel)."""
        data = self._cache[image] if self._cache is not None else self._read_bytes(image)
        try:
            return decode_image(data, color=self.channels == 3)
        except DataError as e:
            raise self.fail(f"{self.image_paths[image]}: {e}") from None

    def _load(self, pos: int) -> PendingBatch:
        crop = self.crop_size
        batch = PendingBatch(np.zeros((self.batch_size, self.channels, crop, crop), dtype=np.float32),
                       np.empty(self.batch_size, dtype=np.float32))
        # the draws are cheap and made here, in stream order; the jobs are the pictures, each
        # decoded once for all of its windows in the batch (they often share one)
        windows: dict[int, list[tuple[int, tuple[int, int, int, int], bool, int]]] = {}
        for i, k in enumerate(self.record_indices(pos)):
            rng = np.random.default_rng([self._seed, int(k)])
            pool = self.bg if i < self.num_bg else self.fg
            image, label, x1, y1, x2, y2, line = (int(v) for v in pool[rng.integers(len(pool))])
            flip = self.mirror and bool(rng.integers(2))
            windows.setdefault(image, []).append((i, (x1, y1, x2, y2), flip, line))
            batch.labels[i] = label
        batch.pending = self._pool.run([functools.partial(self._cut, batch, image, items)
                                        for image, items in windows.items()])
        return batch

    def _cut(self, batch: PendingBatch, image: int,
             items: list[tuple[int, tuple[int, int, int, int], bool, int]]) -> None:
        """One decoding job: a picture, and each of its windows warped into its row."""
        start = time.perf_counter()
        img = self._image(image)
        decoded = time.perf_counter()
        for row, box, flip, line in items:
            self._warp(img, box, flip, batch.data[row], line)
        batch.times.append((decoded - start, time.perf_counter() - decoded))

    def _warp(self, img: np.ndarray, box: tuple[int, int, int, int], flip: bool,
              out: np.ndarray, line: int) -> None:
        """Write one window, warped, into ``out`` (C, crop, crop), which starts at zero."""
        try:
            b = warp_box(box, img.shape[:2], self.crop_size, self.context_pad, self.square, flip)
        except DataError as e:
            raise self.fail(f"{self.source}:{line}: {e}") from None
        if b.out_h <= 0 or b.out_w <= 0:  # a sliver that rounds to nothing
            return
        patch = resize_bilinear(img[b.y1:b.y2 + 1, b.x1:b.x2 + 1], b.out_h, b.out_w)
        if flip:
            patch = patch[:, ::-1]
        where = (slice(None), slice(b.pad_h, b.pad_h + b.out_h), slice(b.pad_w, b.pad_w + b.out_w))
        values = patch.transpose(2, 0, 1).astype(np.float32)
        if self.mean is not None:
            values -= self.mean[where]
        out[where] = values * self.scale


# -- HDF5Output ---------------------------------------------------------------------------------
