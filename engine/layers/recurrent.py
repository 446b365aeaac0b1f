"""Caffe's recurrent layers: RNN, LSTM, and LSTMUnit, the single LSTM step.

Caffe builds RNN and LSTM by unrolling the recurrence into an internal net of InnerProduct,
Scale, Eltwise, TanH and LSTMUnit layers. Here the recurrence is computed directly, one
time step after another, which gives the same numbers with much less machinery. What is
kept exactly is Caffe's contract:

- bottoms: ``x`` (T x N x ...), ``cont`` (T x N; 0 where a sequence starts, which cuts it
  off from the state carried in), an optional static input ``x_static`` (N x ...), and with
  ``recurrent_param.expose_hidden`` the initial states (1 x N x H each: h_0, then c_0 for
  LSTM). Tops: the output of every step (T x N x H), then with ``expose_hidden`` the final
  states (h_T, then c_T for LSTM).
- the parameter blobs, in the order and shapes of the unrolled net's own parameters, so
  weights trained by Caffe load unchanged (D: input size per step, S: static input size):
  LSTM: W_xc (4H x D), b_c (4H), [W_xc_static (4H x S)], W_hc (4H x H), gates i, f, o, g;
  RNN: W_xh (H x D), b_h (H), [W_xh_static (H x S)], W_hh (H x H), W_ho (H x H), b_o (H).
- the recurrence: ``pre_t = W_x x_t + b + W_static x_static + W_h (cont_t * h_{t-1})``,
  then RNN: ``h_t = tanh(pre_t)``, ``o_t = tanh(W_ho h_t + b_o)``; LSTM: LSTMUnit's step.
- without ``expose_hidden`` one forward's final state is the next forward's initial state
  (truncated backpropagation through time over consecutive batches); no gradient crosses
  from one batch to the previous one.

One deliberate difference, where Caffe 1.0 drops gradients: with ``expose_hidden`` the
diffs of the final-state tops flow back through the recurrence and the gradient w.r.t.
the initial-state bottoms is written. Caffe shares only the *data* of those blobs with its
unrolled net, so it ignores the former and never writes the latter. When the final-state
tops get no gradient (the usual case) every number is Caffe's.
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend, glog
from ..blob import Blob
from ..fillers import fill
from .base import Layer, register
from .neuron import sigmoid


# ---------------------------------------------------------------------------------------
# The LSTM step, shared by LSTMUnit and LSTM
# ---------------------------------------------------------------------------------------
def lstm_unit_forward(c_prev: Any, gates: Any, cont: Any,
                      acts: Any | None = None) -> tuple[Any, Any, Any, Any]:
    """One step of Caffe's LSTMUnit on (N, H) cells.

    ``gates`` (N, 4H) holds the pre-activations of i, f, o, g in that order, ``cont`` (N,)
    the continuation flags. Returns ``(c, h, acts, tanh_c)``: the new cell and hidden state,
    the gate activations (N, 4H; sigmoid for i, f, o, tanh for g, with f already multiplied
    by cont) and tanh(c). ``acts`` may be given to receive the activations, even ``gates``
    itself.
    """
    xp = backend.get_array_module(gates)
    hdim = c_prev.shape[-1]
    if acts is None:
        acts = xp.empty_like(gates)
    sigmoid(gates[:, :3 * hdim], acts[:, :3 * hdim])
    xp.tanh(gates[:, 3 * hdim:], out=acts[:, 3 * hdim:])
    keep = cont.reshape(-1, 1)
    # Caffe's f is exactly 0 where cont is 0 rather than cont * sigmoid, so not even an
    # inf or NaN cell leaks across a sequence start
    f = acts[:, hdim:2 * hdim]
    f[...] = xp.where(keep == 0, 0, keep * f)
    i, o, g = acts[:, :hdim], acts[:, 2 * hdim:3 * hdim], acts[:, 3 * hdim:]
    c = f * c_prev + i * g
    tanh_c = xp.tanh(c)
    return c, o * tanh_c, acts, tanh_c


def lstm_unit_backward(dc: Any, dh: Any, c_prev: Any, acts: Any,
                       tanh_c: Any) -> tuple[Any, Any]:
    """Caffe's LSTMUnit backward for one step: from the gradients w.r.t. c and h (N, H) and
    what ``lstm_unit_forward`` returned, the gradients ``(dc_prev, dgates)``.

    As in Caffe, the f gradient is ``dc * c_prev * f * (1 - f)`` with f already scaled by
    cont: the exact derivative for cont in {0, 1}, Caffe's numbers for any other cont.
    """
    xp = backend.get_array_module(acts)
    hdim = c_prev.shape[-1]
    i, f = acts[:, :hdim], acts[:, hdim:2 * hdim]
    o, g = acts[:, 2 * hdim:3 * hdim], acts[:, 3 * hdim:]
    dc_total = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates = xp.empty_like(acts)
    dgates[:, :hdim] = dc_total * g * i * (1 - i)
    dgates[:, hdim:2 * hdim] = dc_total * c_prev * f * (1 - f)
    dgates[:, 2 * hdim:3 * hdim] = dh * tanh_c * o * (1 - o)
    dgates[:, 3 * hdim:] = dc_total * i * (1 - g * g)
    return dc_total * f, dgates


@register("LSTMUnit")
class LSTMUnitLayer(Layer):
    """Caffe's LSTMUnit: bottoms c_prev (1 x N x H), gate inputs (1 x N x 4H, i f o g) and
    cont (1 x N); tops c and h (1 x N x H each)::

        i, f, o = sigmoid(x_i), cont * sigmoid(x_f), sigmoid(x_o);  g = tanh(x_g)
        c = f * c_prev + i * g;  h = o * tanh(c)

    No gradient reaches cont.
    """

    exact_num_bottoms = 3
    exact_num_tops = 2

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        n = bottom[0].shape[1] if bottom[0].num_axes() > 1 else -1
        for k, b in enumerate(bottom):
            axes = 2 if k == 2 else 3
            if b.num_axes() != axes or b.shape[0] != 1 or b.shape[1] != n:
                raise self.fail(f"bottom {k} has shape {b.shape}; expected {axes} axes "
                                f"(1, N{', ...' if axes == 3 else ''}) with N = {n} as in "
                                f"bottom 0")
        self.hidden = bottom[0].shape[2]
        if bottom[1].shape[2] != 4 * self.hidden:
            raise self.fail(f"gate input (bottom 1) has {bottom[1].shape[2]} channels; "
                            f"needs 4 x {self.hidden} for the cell size of bottom 0")
        top[0].reshape(bottom[0].shape)
        top[1].reshape(bottom[0].shape)

    def _step(self, bottom: Sequence[Blob]) -> tuple[Any, Any, Any, Any, Any]:
        c_prev = bottom[0].data[0]
        return (c_prev, *lstm_unit_forward(c_prev, bottom[1].data[0], bottom[2].data[0]))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        _, c, h, _, _ = self._step(bottom)
        top[0].data[0] = c
        top[1].data[0] = h

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[2]:
            raise self.fail("cannot backpropagate to the sequence indicators (bottom 2)")
        if not (propagate_down[0] or propagate_down[1]):
            return
        # recomputed from the bottoms, as Caffe does, rather than kept from forward
        c_prev, _, _, acts, tanh_c = self._step(bottom)
        dc_prev, dgates = lstm_unit_backward(top[0].diff[0], top[1].diff[0], c_prev, acts,
                                             tanh_c)
        if propagate_down[0]:
            bottom[0].diff[0] = dc_prev
        if propagate_down[1]:
            bottom[1].diff[0] = dgates

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 2


# ---------------------------------------------------------------------------------------
# The recurrent machinery, shared by RNN and LSTM
# ---------------------------------------------------------------------------------------
class RecurrentLayer(Layer):
    """Caffe's RecurrentLayer: the bottoms, tops, parameters and time loop common to RNN
    and LSTM (see the module docstring). A subclass names its states and gives the cell
    (``_cell_forward`` / ``_cell_backward``) and, when the output is not h itself, the
    output transform and its parameters.
    """

    #: the recurrent states in Caffe's order of the exposed bottoms and tops; h comes first
    #: and is the one fed back through W_h
    state_names: tuple[str, ...] = ("h",)
    #: pre-activation rows per hidden unit (LSTM: its 4 gates)
    gates_per_unit: int = 1

    def __init__(self, param: Any, phase: str = "TRAIN"):
        super().__init__(param, phase)
        exposed = len(self.state_names) if param.recurrent_param.expose_hidden else 0
        self.min_bottoms = 2 + exposed
        self.max_bottoms = 3 + exposed
        self.exact_num_tops = 1 + exposed

    # -- hooks for the subclasses ---------------------------------------------------------
    def _output_params(self) -> list[tuple[tuple[int, ...], bool]]:
        """(shape, is_bias) of the parameters after W_h, which only the output uses."""
        return []

    def _begin_sequence(self, steps: int, streams: int, xp: Any, dtype: Any) -> None:
        """Make the per-step buffers a forward pass of this size needs."""

    def _cell_forward(self, t: int, pre: Any, cont: Any, prev: list[Any],
                      out: list[Any]) -> None:
        """Write the states of step t (``out``) from the pre-activation (N, G), which the
        cell may overwrite, and the states before (``prev``)."""
        raise NotImplementedError

    def _cell_backward(self, t: int, d_states: list[Any], cont: Any) -> tuple[Any, list[Any]]:
        """From the gradients w.r.t. step t's states: the gradient w.r.t. its
        pre-activation and w.r.t. the previous states other than h (h's goes through W_h)."""
        raise NotImplementedError

    def _emit(self, hidden: Any, out: Any) -> None:
        """The layer's output (T, N, H) from the hidden states h_1..h_T."""
        out[...] = hidden

    def _emit_backward(self, hidden: Any, dout: Any) -> Any:
        """The gradient w.r.t. h_1..h_T from the output's (read only, never written); adds
        the output parameters' gradients."""
        return dout

    # -- the layer contract --------------------------------------------------------------
    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.recurrent_param
        if p.num_output <= 0:
            raise self.fail("recurrent_param.num_output must be positive")
        self.hidden = int(p.num_output)
        self.expose_hidden = bool(p.expose_hidden)
        self.debug_info = bool(p.debug_info)
        x = bottom[0]
        if x.num_axes() < 2:
            raise self.fail(f"bottom 0 must have at least 2 axes (#timesteps, #streams, ...), "
                            f"got shape {x.shape}")
        self.steps = x.shape[0]
        exposed = len(self.state_names) if self.expose_hidden else 0
        self.static_input = len(bottom) > 2 + exposed
        self.first_hidden_bottom = 2 + int(self.static_input)
        if self.static_input and bottom[2].num_axes() < 1:
            raise self.fail("the static input (bottom 2) must have a first (#streams) axis")
        self.input_dim = x.count_range(2)
        self.static_dim = bottom[2].count_range(1) if self.static_input else 0

        width = self.gates_per_unit * self.hidden
        # Caffe's order: the x transform's weight and bias, the static transform's weight,
        # the recurrent weight, then the output's own
        specs: list[tuple[tuple[int, ...], bool]] = [((width, self.input_dim), False),
                                                     ((width,), True)]
        if self.static_input:
            specs.append(((width, self.static_dim), False))
        self.w_h_index = len(specs)
        specs.append(((width, self.hidden), False))
        self.output_index = len(specs)
        specs += self._output_params()
        xp = backend.get_array_module(x.data)
        self.blobs = []
        for j, (shape, is_bias) in enumerate(specs):
            blob = Blob(shape, dtype=x.dtype, xp=xp, name=f"{self.name}/{j}")
            fill(p.bias_filler if is_bias else p.weight_filler, blob)
            self.blobs.append(blob)
        self.param_propagate_down = [True] * len(self.blobs)
        self._carried: list[Any] | None = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x, cont = bottom[0], bottom[1]
        if x.num_axes() < 2:
            raise self.fail(f"bottom 0 must have at least 2 axes (#timesteps, #streams, ...), "
                            f"got shape {x.shape}")
        if x.shape[0] != self.steps:
            raise self.fail(f"input number of timesteps changed: {x.shape[0]}, was "
                            f"{self.steps} at setup")
        if x.count_range(2) != self.input_dim:
            raise self.fail(f"bottom 0 of shape {x.shape} has {x.count_range(2)} inputs per "
                            f"step; the weights expect {self.input_dim}")
        streams = x.shape[1]
        if cont.shape != (self.steps, streams):
            raise self.fail(f"the sequence indicators (bottom 1) must be (T, N) = "
                            f"{(self.steps, streams)}, got shape {cont.shape}")
        if self.static_input:
            s = bottom[2]
            if s.num_axes() < 1 or s.shape[0] != streams or s.count_range(1) != self.static_dim:
                raise self.fail(f"the static input (bottom 2) must be (N, ...) with N = "
                                f"{streams} and {self.static_dim} values per stream, got "
                                f"shape {s.shape}")
        state_shape = (1, streams, self.hidden)
        if self.expose_hidden:
            for k, name in enumerate(self.state_names):
                b = bottom[self.first_hidden_bottom + k]
                if b.shape != state_shape:
                    raise self.fail(f"initial state {name}_0 (bottom "
                                    f"{self.first_hidden_bottom + k}) must have shape "
                                    f"{state_shape}, got {b.shape}")
            for t in top[1:]:
                t.reshape(state_shape)
        top[0].reshape((self.steps, streams, self.hidden))
        self.streams = streams
        if self._carried is not None and self._carried[0].shape[0] != streams:
            self._carried = None  # another batch size: the carried state means nothing

    def reset(self) -> None:
        """Forget the state carried between forward passes (Caffe's Reset)."""
        self._carried = None

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        xp = backend.get_array_module(x)
        steps, streams, hdim = self.steps, self.streams, self.hidden
        cont = bottom[1].data
        w = [b.data for b in self.blobs]
        pre = xp.matmul(x.reshape(steps * streams, self.input_dim), w[0].T)
        pre = pre.reshape(steps, streams, -1)
        pre += w[1]
        if self.static_input:
            pre += xp.matmul(bottom[2].data.reshape(streams, self.static_dim), w[2].T)
        w_h = w[self.w_h_index]

        self._seq = [xp.empty((steps + 1, streams, hdim), dtype=x.dtype)
                     for _ in self.state_names]
        for k, seq in enumerate(self._seq):
            if self.expose_hidden:
                seq[0] = bottom[self.first_hidden_bottom + k].data[0]
            elif self._carried is not None:
                seq[0] = self._carried[k]
            else:
                seq[0] = 0
        self._begin_sequence(steps, streams, xp, x.dtype)
        for t in range(steps):
            conted = cont[t].reshape(-1, 1) * self._seq[0][t]
            pre[t] += xp.matmul(conted, w_h.T)
            self._cell_forward(t, pre[t], cont[t], [s[t] for s in self._seq],
                               [s[t + 1] for s in self._seq])
        self._emit(self._seq[0][1:], top[0].data)
        if self.expose_hidden:
            for t, seq in zip(top[1:], self._seq):
                t.data[0] = seq[steps]
        else:
            self._carried = [seq[steps].copy() for seq in self._seq]
        if self.debug_info:
            self._log("Forward", "top", "data", zip(self._top_names(top), top))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[1]:
            raise self.fail("cannot backpropagate to the sequence indicators (bottom 1)")
        if not any(propagate_down) and not any(self.param_propagate_down):
            return
        x = bottom[0].data
        xp = backend.get_array_module(x)
        steps, streams = self.steps, self.streams
        cont = bottom[1].data
        hidden = self._seq[0]
        w = [b.data for b in self.blobs]
        w_h = w[self.w_h_index]

        d_hidden = self._emit_backward(hidden[1:], top[0].diff)
        if self.expose_hidden:
            carry = [t.diff[0].copy() for t in top[1:]]
        else:
            carry = [xp.zeros_like(hidden[0]) for _ in self.state_names]
        d_pre = xp.empty((steps, streams, w_h.shape[0]), dtype=x.dtype)
        for t in range(steps - 1, -1, -1):
            carry[0] += d_hidden[t]
            d_pre[t], rest = self._cell_backward(t, carry, cont[t])
            carry = [cont[t].reshape(-1, 1) * xp.matmul(d_pre[t], w_h), *rest]

        flat = d_pre.reshape(steps * streams, -1)
        x2 = x.reshape(steps * streams, self.input_dim)
        down = self.param_propagate_down
        if down[0]:
            self.blobs[0].diff += xp.matmul(flat.T, x2)
        if down[1]:
            self.blobs[1].diff += flat.sum(axis=0)
        if down[self.w_h_index]:
            conted = cont.reshape(steps, streams, 1) * hidden[:steps]
            self.blobs[self.w_h_index].diff += xp.matmul(
                flat.T, conted.reshape(steps * streams, -1))
        if propagate_down[0]:
            xp.matmul(flat, w[0], out=bottom[0].diff.reshape(steps * streams, self.input_dim))
        if self.static_input:
            # x_static is added at every step, so its gradient is the sum over the steps
            d_static = d_pre.sum(axis=0)
            xs = bottom[2].data.reshape(streams, self.static_dim)
            if down[2]:
                self.blobs[2].diff += xp.matmul(d_static.T, xs)
            if propagate_down[2]:
                xp.matmul(d_static, w[2], out=bottom[2].diff.reshape(streams, self.static_dim))
        if self.expose_hidden:
            for k, d in enumerate(carry):
                if propagate_down[self.first_hidden_bottom + k]:
                    bottom[self.first_hidden_bottom + k].diff[0] = d
        if self.debug_info:
            named = [(f"bottom {j}", b) for j, b in enumerate(bottom) if propagate_down[j]]
            named += [(f"param {j}", b) for j, b in enumerate(self.blobs) if down[j]]
            self._log("Backward", "", "diff", named)

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1

    # -- helpers --------------------------------------------------------------------------
    def _top_names(self, top: Sequence[Blob]) -> list[str]:
        tops = list(self.param.top)
        return [tops[j] if j < len(tops) else f"top {j}" for j in range(len(top))]

    def _log(self, direction: str, kind: str, field: str, named: Any) -> None:
        """Caffe's debug_info line per blob: the mean absolute value of data or diff."""
        for name, blob in named:
            values = getattr(blob, field)
            mean_abs = float(abs(values).mean()) if values.size else 0.0
            label = f"{kind} blob {name}" if kind else name
            glog.info(f"    [{direction}] Layer {self.name}, {label} {field}: "
                      f"{glog.fmt(mean_abs)}")


@register("RNN")
class RNNLayer(RecurrentLayer):
    """Caffe's RNN: ``h_t = tanh(W_xh x_t + b_h + W_xh_static x_static +
    W_hh (cont_t * h_{t-1}))`` and the output ``o_t = tanh(W_ho h_t + b_o)``; blobs W_xh,
    b_h, [W_xh_static], W_hh, W_ho, b_o. With ``expose_hidden``: bottom h_0, top h_T."""

    state_names = ("h",)
    gates_per_unit = 1

    def _output_params(self) -> list[tuple[tuple[int, ...], bool]]:
        return [((self.hidden, self.hidden), False), ((self.hidden,), True)]

    def _cell_forward(self, t: int, pre: Any, cont: Any, prev: list[Any],
                      out: list[Any]) -> None:
        backend.get_array_module(pre).tanh(pre, out=out[0])

    def _cell_backward(self, t: int, d_states: list[Any], cont: Any) -> tuple[Any, list[Any]]:
        h = self._seq[0][t + 1]
        return d_states[0] * (1 - h * h), []

    def _emit(self, hidden: Any, out: Any) -> None:
        xp = backend.get_array_module(hidden)
        w, b = self.blobs[self.output_index].data, self.blobs[self.output_index + 1].data
        o = xp.matmul(hidden.reshape(-1, self.hidden), w.T)
        o += b
        xp.tanh(o, out=o)
        # kept for backward: a layer working in place on the top may change its data
        self._out = o
        out[...] = o.reshape(out.shape)

    def _emit_backward(self, hidden: Any, dout: Any) -> Any:
        xp = backend.get_array_module(hidden)
        o = self._out
        d_o = dout.reshape(o.shape) * (1 - o * o)
        w, b = self.blobs[self.output_index], self.blobs[self.output_index + 1]
        if self.param_propagate_down[self.output_index]:
            w.diff += xp.matmul(d_o.T, hidden.reshape(-1, self.hidden))
        if self.param_propagate_down[self.output_index + 1]:
            b.diff += d_o.sum(axis=0)
        return xp.matmul(d_o, w.data).reshape(hidden.shape)


@register("LSTM")
class LSTMLayer(RecurrentLayer):
    """Caffe's LSTM: gate inputs ``W_xc x_t + b_c + W_xc_static x_static +
    W_hc (cont_t * h_{t-1})`` (i, f, o, g) through LSTMUnit's step; the output is h. Blobs
    W_xc, b_c, [W_xc_static], W_hc. With ``expose_hidden``: bottoms h_0, c_0 and tops h_T,
    c_T, in that order."""

    state_names = ("h", "c")
    gates_per_unit = 4

    def _begin_sequence(self, steps: int, streams: int, xp: Any, dtype: Any) -> None:
        self._acts = xp.empty((steps, streams, 4 * self.hidden), dtype=dtype)
        self._tanh_c = xp.empty((steps, streams, self.hidden), dtype=dtype)

    def _cell_forward(self, t: int, pre: Any, cont: Any, prev: list[Any],
                      out: list[Any]) -> None:
        c, h, _, tanh_c = lstm_unit_forward(prev[1], pre, cont, self._acts[t])
        self._tanh_c[t] = tanh_c
        out[0][...] = h
        out[1][...] = c

    def _cell_backward(self, t: int, d_states: list[Any], cont: Any) -> tuple[Any, list[Any]]:
        dh, dc = d_states
        dc_prev, dgates = lstm_unit_backward(dc, dh, self._seq[1][t], self._acts[t],
                                             self._tanh_c[t])
        return dgates, [dc_prev]
