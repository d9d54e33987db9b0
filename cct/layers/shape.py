"""Layers that move, copy or re-view data without arithmetic on it (Caffe's "utility" layers).

Concat, Slice, Split, Flatten, Reshape, Crop, Tile, Silence, Filter and BatchReindex.  Where Caffe
lets a top alias its bottom (Split's data; Flatten/Reshape data and diff; a single-input Concat or a
single-output Slice) the top shares the bottom's memory, so forward and backward have nothing to do.
"""
from __future__ import annotations

from collections.abc import Sequence

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.runtime.partition import batch_rows, run_batch


def canonical_axis(blob: Blob, axis: int, field: str) -> int:
    """Caffe's ``CanonicalAxisIndex`` (negative axes count from the end), as a ParamError on ``field``."""
    n = blob.num_axes
    if not -n <= axis < n:
        raise ParamError(field, f"axis {axis} out of range for a {n}-D bottom blob with shape "
                                f"{blob.shape_string()}")
    return axis + n if axis < 0 else axis


def _axis_slice(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    """An index selecting ``start:stop`` along ``axis`` and everything along the other axes."""
    return (slice(None),) * axis + (slice(start, stop),)


def _legacy_or_axis(param, bottom: Blob, legacy: str, section: str) -> int:
    """The axis of Concat/Slice: ``axis`` (negative allowed) or the legacy unsigned ``<legacy>``."""
    if param.HasField("axis") and param.HasField(legacy):
        raise ParamError(section, f"either axis or {legacy} should be specified; not both")
    if param.HasField(legacy):
        value = getattr(param, legacy)
        if value >= bottom.num_axes:
            raise ParamError(f"{section}.{legacy}", f"{legacy} {value} out of range for a "
                                                    f"{bottom.num_axes}-D bottom blob")
        return value
    return canonical_axis(bottom, param.axis, f"{section}.axis")


@register("Concat")
class ConcatLayer(Layer):
    """Joins its inputs along one axis.

    Bottoms: ≥1 blobs whose shapes agree except along ``axis``.  Top: one blob with
    ``shape[axis] = Σ_i bottom_i.shape[axis]``; ``y = [x_0, x_1, ...]`` along ``axis``.
    Backward copies each slice of the top diff back to its bottom.

    Parameters (``concat_param``): ``axis`` (1, negative counts from the end) or the legacy
    ``concat_dim`` (not both).  A single bottom is passed through: the top shares its data and diff.
    """

    min_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.axis != 0)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.axis = _legacy_or_axis(self.layer_param.concat_param, bottom[0], "concat_dim", "concat_param")
        axis = self.axis
        shape = list(bottom[0].shape)
        for i, b in enumerate(bottom[1:], 1):
            if b.num_axes != len(shape):
                raise CctError(f"Concat: all inputs must have the same number of axes (bottom[0] is "
                               f"{bottom[0].shape_string()}, bottom[{i}] is {b.shape_string()})")
            if any(d != e for j, (d, e) in enumerate(zip(b.shape, bottom[0].shape)) if j != axis):
                raise CctError(f"Concat: all inputs must have the same shape except along axis {axis} "
                               f"(bottom[0] is {bottom[0].shape_string()}, bottom[{i}] is "
                               f"{b.shape_string()})")
            shape[axis] += b.shape[axis]
        top[0].reshape(shape)
        if len(bottom) == 1:
            top[0].share_data(bottom[0])
            top[0].share_diff(bottom[0])

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        if len(bottom) == 1:
            return
        out = top[0].data
        offset = 0
        for b in bottom:
            n = b.shape[self.axis]
            out[_axis_slice(self.axis, offset, offset + n)] = b.data
            offset += n

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if len(bottom) == 1:
            return
        td = top[0].diff
        offset = 0
        for b, down in zip(bottom, propagate_down):
            n = b.shape[self.axis]
            if down:
                b.diff[...] = td[_axis_slice(self.axis, offset, offset + n)]
            offset += n


@register("Slice")
class SliceLayer(Layer):
    """Cuts its input along one axis into consecutive pieces, one per top.

    Bottom: one blob.  Tops: k ≥ 1 blobs; top i holds ``x[..., p_{i-1}:p_i, ...]`` along ``axis``.
    Backward copies each top diff back into its slice of the bottom diff.

    Parameters (``slice_param``): ``axis`` (1, negative counts from the end) or the legacy ``slice_dim``
    (not both); ``slice_point``: k-1 increasing cut positions, or none for k equal pieces (the axis must
    divide evenly).  A single top is passed through: it shares the bottom's data and diff.
    """

    exact_num_bottom = 1
    min_top = 1
    batch_separable = property(lambda self: self.axis != 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.slice_points = list(self.layer_param.slice_param.slice_point)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        self.axis = _legacy_or_axis(self.layer_param.slice_param, bottom[0], "slice_dim", "slice_param")
        total = bottom[0].shape[self.axis]
        k = len(top)
        if self.slice_points:
            if len(self.slice_points) != k - 1:
                raise ParamError("slice_param.slice_point", f"{len(self.slice_points)} slice points given "
                                 f"for {k} tops (need {k - 1})")
            if k > total:
                raise ParamError("top", f"{k} tops cannot slice an axis of size {total}")
            sizes, prev = [], 0
            for p in self.slice_points:
                if p <= prev:
                    raise ParamError("slice_param.slice_point", f"slice points must be increasing and "
                                     f"positive (got {self.slice_points})")
                sizes.append(p - prev)
                prev = p
            if prev > total:
                raise ParamError("slice_param.slice_point", f"slice point {prev} is past the end of axis "
                                 f"{self.axis} (size {total}) of bottom {bottom[0].shape_string()}")
            sizes.append(total - prev)
        else:
            if total % k:
                raise ParamError("top", f"number of top blobs ({k}) should evenly divide input slice axis "
                                        f"({total}) of bottom {bottom[0].shape_string()}")
            sizes = [total // k] * k
        self.sizes = sizes
        for t, n in zip(top, sizes):
            shape = list(bottom[0].shape)
            shape[self.axis] = n
            t.reshape(shape)
        if k == 1:
            top[0].share_data(bottom[0])
            top[0].share_diff(bottom[0])

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        if len(top) == 1:
            return
        x = bottom[0].data
        offset = 0
        for t, n in zip(top, self.sizes):
            t.data[...] = x[_axis_slice(self.axis, offset, offset + n)]
            offset += n

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if len(top) == 1 or not propagate_down[0]:
            return
        bd = bottom[0].diff
        offset = 0
        for t, n in zip(top, self.sizes):
            bd[_axis_slice(self.axis, offset, offset + n)] = t.diff
            offset += n


@register("Split")
class SplitLayer(Layer):
    """Hands one blob to several consumers (inserted by the net wherever a top feeds several bottoms).

    Bottom: one blob.  Tops: k ≥ 1 blobs of the same shape that share the bottom's data (no copy).
    Backward: ``bd = Σ_k td_k``.  In-place computation is not allowed.
    """

    exact_num_bottom = 1
    min_top = 1
    allow_in_place = False
    batch_separable = True

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        for t in top:
            t.reshape(bottom[0].shape)
            t.share_data(bottom[0])

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass  # the tops already share the bottom's data

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        bd = bottom[0].diff
        if len(top) == 1:
            bd[...] = top[0].diff
            return
        xp = get_array_module(bd)
        rows = [batch_rows(bd)] + [batch_rows(t.diff) for t in top]

        def add(_part: int, a: int, b: int) -> None:  # the tops' gradients summed in order, over the partitions
            xp.add(rows[1][a:b], rows[2][a:b], out=rows[0][a:b])
            for t in rows[3:]:
                rows[0][a:b] += t[a:b]

        run_batch(len(rows[0]), add, work=float(rows[0].shape[1] * len(top)))


@register("Flatten")
class FlattenLayer(Layer):
    """Merges the axes ``axis..end_axis`` into one: a view, no copy.

    Top shape: ``shape[:axis] + [prod(shape[axis:end_axis+1])] + shape[end_axis+1:]``; the top shares
    the bottom's data and diff.  Parameters (``flatten_param``): ``axis`` (1), ``end_axis`` (-1); both
    may be negative.  In-place computation is not allowed.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.flatten_param
        b = bottom[0]
        start = canonical_axis(b, p.axis, "flatten_param.axis")
        end = canonical_axis(b, p.end_axis, "flatten_param.end_axis")
        if end + 1 < start:
            raise ParamError("flatten_param.end_axis", f"end_axis {p.end_axis} comes before axis {p.axis} "
                                                       f"for bottom {b.shape_string()}")
        top[0].reshape(b.shape[:start] + (b.count_range(start, end + 1),) + b.shape[end + 1:])
        top[0].share_data(b)
        top[0].share_diff(b)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass  # shared memory

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        pass  # shared memory


@register("Reshape")
class ReshapeLayer(Layer):
    """Gives the bottom's data a new shape: a view, no copy.

    Top shape: ``shape[:axis] + reshape_param.shape + shape[axis+num_axes:]`` where in the new dims a
    ``0`` copies the bottom dim at the same position and one ``-1`` is inferred so the counts match.
    Parameters (``reshape_param``): ``shape``, ``axis`` (0; negative: ``num_axes + axis + 1``),
    ``num_axes`` (-1 = to the end).  The top shares data and diff; in-place is not allowed.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = False

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        dims = list(self.layer_param.reshape_param.shape.dim)
        self.copy_axes = [i for i, d in enumerate(dims) if d == 0]
        inferred = [i for i, d in enumerate(dims) if d == -1]
        if len(inferred) > 1:
            raise ParamError("reshape_param.shape", f"new shape {dims} contains several -1 dims; at most "
                                                    f"one may be inferred")
        if any(d < -1 for d in dims):
            raise ParamError("reshape_param.shape", f"new shape {dims} has a dim below -1")
        self.inferred_axis = inferred[0] if inferred else None
        self.new_dims = dims
        self.constant_count = 1
        for d in dims:
            if d > 0:
                self.constant_count *= d

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.reshape_param
        b = bottom[0]
        n = b.num_axes
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            raise ParamError("reshape_param.axis", f"axis {p.axis} out of range for a {n}-D bottom blob "
                                                   f"{b.shape_string()}")
        if p.num_axes < -1:
            raise ParamError("reshape_param.num_axes", f"num_axes must be >= 0, or -1 for all "
                                                       f"(got {p.num_axes})")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            raise ParamError("reshape_param.num_axes", f"axis + num_axes = {end} is out of range for a "
                                                       f"{n}-D bottom blob {b.shape_string()}")
        shape = list(b.shape[:start]) + list(self.new_dims) + list(b.shape[end:])
        for i in self.copy_axes:
            if start + i >= n:
                raise ParamError("reshape_param.shape", f"new shape {self.new_dims} contains a 0 at position "
                                 f"{i}, but bottom {b.shape_string()} has no axis {start + i} to copy")
            shape[start + i] = b.shape[start + i]
        if self.inferred_axis is not None:
            explicit = self.constant_count * b.count_range(0, start) * b.count_range(end)
            for i in self.copy_axes:
                explicit *= shape[start + i]
            if explicit == 0 or b.count % explicit:
                raise ParamError("reshape_param.shape", f"bottom count ({b.count}, shape {b.shape_string()}) "
                                 f"must be divisible by the product of the specified dimensions ({explicit})")
            shape[start + self.inferred_axis] = b.count // explicit
        count = 1
        for d in shape:
            count *= d
        if count != b.count:
            raise ParamError("reshape_param.shape", f"output count must match input count: new shape "
                                                    f"{shape} ({count}) vs bottom {b.shape_string()}")
        top[0].reshape(shape)
        top[0].share_data(b)
        top[0].share_diff(b)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass  # shared memory

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        pass  # shared memory


@register("Crop")
class CropLayer(Layer):
    """Cuts a window out of bottom 0 the size of bottom 1 in the axes from ``axis`` on.

    Bottoms: data x, reference r (only its shape is used).  Top shape: ``x.shape[:axis] + r.shape[axis:]``;
    ``y = x[..., o_axis : o_axis + r_axis, ..., o_last : o_last + r_last]``.  Backward: ``bd`` is zero
    except the window, which receives ``td``; nothing goes to the reference.

    Parameters (``crop_param``): ``axis`` (2, negative allowed); ``offset``: none → 0, one → used for
    every cropped axis, else one per axis from ``axis`` on.
    """

    exact_num_bottom = 2
    exact_num_top = 1
    batch_separable = property(lambda self: self.layer_param.crop_param.axis > 0)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.crop_param
        x, ref = bottom
        n = x.num_axes
        start = canonical_axis(x, p.axis, "crop_param.axis")
        offsets = list(p.offset)
        if len(offsets) > 1 and start + len(offsets) != n:
            raise ParamError("crop_param.offset", f"{len(offsets)} offsets given; need one per axis from "
                                                  f"axis {start} of bottom {x.shape_string()} ({n - start})")
        if ref.num_axes < n:
            raise CctError(f"Crop: the reference bottom {ref.shape_string()} has fewer axes than the data "
                           f"bottom {x.shape_string()}")
        shape = list(x.shape)
        window = []
        for i in range(n):
            off = 0
            if i >= start:
                off = offsets[0] if len(offsets) == 1 else (offsets[i - start] if offsets else 0)
                shape[i] = ref.shape[i]
                if x.shape[i] - off < ref.shape[i]:
                    raise ParamError("crop_param.offset", f"invalid crop in axis {i}: offset {off} + size "
                                     f"{ref.shape[i]} exceeds {x.shape[i]} (data {x.shape_string()}, "
                                     f"reference {ref.shape_string()})")
            window.append(slice(off, off + shape[i]))
        self.window = tuple(window)
        top[0].reshape(shape)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        top[0].data[...] = bottom[0].data[self.window]

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            bd = bottom[0].diff
            bd[...] = 0
            bd[self.window] = top[0].diff


@register("Tile")
class TileLayer(Layer):
    """Repeats the block from ``axis`` on ``tiles`` times.

    Top shape: bottom shape with ``shape[axis] *= tiles``; viewing x as ``(outer, count(axis))`` and y as
    ``(outer, tiles, count(axis))``, ``y[o, t] = x[o]``.  Backward: ``bd[o] = Σ_t td[o, t]``.
    Parameters (``tile_param``): ``axis`` (1, negative allowed), ``tiles`` (required, > 0).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.axis > 0)

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.tile_param
        if not p.HasField("tiles"):
            raise ParamError("tile_param.tiles", "number of tiles must be specified")
        if p.tiles <= 0:
            raise ParamError("tile_param.tiles", f"number of tiles must be positive (got {p.tiles})")
        self.tiles = p.tiles

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        b = bottom[0]
        self.axis = canonical_axis(b, self.layer_param.tile_param.axis, "tile_param.axis")
        shape = list(b.shape)
        shape[self.axis] *= self.tiles
        top[0].reshape(shape)
        self.outer = b.count_range(0, self.axis)
        self.inner = b.count_range(self.axis)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        top[0].data.reshape(self.outer, self.tiles, self.inner)[...] = \
            bottom[0].data.reshape(self.outer, 1, self.inner)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            xp = get_array_module(top[0].diff)
            xp.sum(top[0].diff.reshape(self.outer, self.tiles, self.inner), axis=1,
                   out=bottom[0].diff.reshape(self.outer, self.inner))


@register("Silence")
class SilenceLayer(Layer):
    """Consumes blobs that nothing else uses (so they are not reported as net outputs).

    Bottoms: ≥1 blobs; no tops.  Backward (only under ``force_backward``) sets the bottom diffs to 0.
    """

    min_bottom = 1
    exact_num_top = 0

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff[...] = 0


@register("Filter")
class FilterLayer(Layer):
    """Keeps the items (along axis 0) whose selector is non-zero.

    Bottoms: k data blobs, then the selector ``s`` of shape ``(N, 1, ...)`` (all dims but the first 1),
    every data blob with first dim N.  Tops: k blobs; top i holds ``x_i[n]`` for each n with ``s[n] != 0``,
    in order.  The first reshape (at setup) sizes the tops with the full batch, as Caffe does.
    Backward: forwarded items get their top diff, the others 0; the selector gets no gradient.
    """

    min_bottom = 2
    min_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        if len(top) != len(bottom) - 1:
            raise ParamError("top", f"Filter Layer produces one top per data bottom: {len(bottom) - 1} "
                                    f"expected, got {len(top)}")
        self._first_reshape = True
        self._selector_index = len(bottom) - 1

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        sel = bottom[-1]
        if sel.num_axes == 0 or any(d != 1 for d in sel.shape[1:]):
            raise CctError(f"Filter: selector blob dimensions must be singletons (1), except the first "
                           f"(got {sel.shape_string()})")
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes == 0 or b.shape[0] != sel.shape[0]:
                raise CctError(f"Filter: bottom[{i}] {b.shape_string()} must have the same first dimension "
                               f"as the selector {sel.shape_string()}")
        xp = get_array_module(sel.data)
        self.indices = xp.nonzero(sel.data.reshape(-1))[0]
        n = sel.shape[0] if self._first_reshape else int(self.indices.size)
        self._first_reshape = False
        for t, b in zip(top, bottom):
            t.reshape((n,) + b.shape[1:])

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        for t, b in zip(top, bottom):
            t.data[...] = b.data[self.indices]

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[-1]:
            raise CctError(f"layer '{self.name}' (Filter) cannot backpropagate to the selector input")
        for t, b, down in zip(top, bottom, propagate_down):
            if down:
                bd = b.diff
                bd[...] = 0
                bd[self.indices] = t.diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != self._selector_index


@register("BatchReindex")
class BatchReindexLayer(Layer):
    """Gathers items along axis 0: ``y[i] = x[int(idx[i])]``.

    Bottoms: data x ``(N, ...)``, index ``idx`` of shape ``(M,)`` with values in ``[0, N)`` (truncated to
    int).  Top: ``(M, ...)``.  Backward: ``bd[n] = Σ_{i: idx[i]=n} td[i]`` (zero for unused items); the
    index gets no gradient.
    """

    exact_num_bottom = 2
    exact_num_top = 1

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        x, idx = bottom
        if idx.num_axes != 1:
            raise CctError(f"BatchReindex: the index bottom must be 1-D (got {idx.shape_string()})")
        if x.num_axes == 0:
            raise CctError("BatchReindex: the data bottom needs at least one axis")
        top[0].reshape((idx.shape[0],) + x.shape[1:])

    def _indices(self, bottom: list[Blob]):
        x, idx = bottom
        values = idx.data
        xp = get_array_module(values)
        if values.size and (bool((values < 0).any()) or bool((values >= x.shape[0]).any())):
            raise CctError(f"BatchReindex: indices must lie in [0, {x.shape[0]}) "
                           f"(got min {float(values.min())}, max {float(values.max())})")
        return values.astype(xp.int64)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        top[0].data[...] = bottom[0].data[self._indices(bottom)]

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[1]:
            raise CctError(f"layer '{self.name}' (BatchReindex) cannot backpropagate to the index input")
        if not propagate_down[0]:
            return
        x = bottom[0]
        idx = self._indices(bottom)
        xp = get_array_module(idx)
        # Scatter-add as a product with the (N, M) one-hot matrix of the indices: vectorised on both
        # array modules, and repeated indices sum.
        onehot = (xp.arange(x.shape[0])[:, None] == idx[None, :]).astype(x.dtype)
        inner = x.count_range(1)
        xp.matmul(onehot, top[0].diff.reshape(idx.shape[0], inner), out=x.diff.reshape(x.shape[0], inner))

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1
