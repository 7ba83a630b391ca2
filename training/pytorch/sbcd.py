"""DP-SBCD for PyTorch: differentially private block coordinate descent for ReLU networks.

Import as ``hidden_state_accountants.pytorch.sbcd`` (plain PyTorch: Opacus is not needed).

>>> import torch
>>> from hidden_state_accountants.pytorch.sbcd import DPSBCD
>>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
>>> X, y = torch.randn(600, 64), torch.randint(0, 10, (600,))
>>> opt = DPSBCD(model, X, y, batch_size=200, step_size=0.5, noise=1e-3, rho=1.0,
...              regularizer="l2", regularization=0.05)
>>> opt.seed_is_secret  # no seed given: the partition and the noise come from a secret draw
True
>>> _ = opt.fit(epochs=2, progress=False)
>>> eps = opt.get_epsilon(1e-5)

DP-SBCD (Algorithm 2 of *Differentially Private Network Training under Hidden State
Assumption*, ICLR 2025 submission, arXiv:2407.08233) is not a gradient method: it keeps
per-example auxiliary variables ``x_d`` (layer inputs) and ``u_d`` (pre-activations) for every
training record and updates, for each mini-batch and each layer ``d = 0..D`` in turn,

* ``x_d`` in closed form (eq. 4), then clips it to norm ``rho_d`` (eq. 5),
* ``u_d`` in closed form (eq. 6, re-derived: the element-wise minimiser of
  ``(x_{d+1} - relu(u))^2 + (u - theta_d x_d)^2``, comparing the ``u <= 0`` and ``u >= 0``
  branches; the PDF's case list is garbled),
* ``theta_d`` by the noisy proximal gradient step (eq. 8) or the Appendix C closed-form variant.

It therefore owns the training data and the batch schedule: the records are split into
``n // b`` batches once (at random for ``sampling=SHUFFLE_PARTITION``, in order for ``CYCLIC``)
by the core's :class:`~hidden_state_accountants.schedules.BatchSchedule` and visited in the same
order every epoch, as the accountant requires. ``step()`` runs one mini-batch; :meth:`DPSBCD.fit` runs
epochs with a progress bar.

The loss is the squared loss ``R(z; y) = gamma/2 ||z - y||^2`` on one-hot labels (the paper's
experiments; it keeps eq. 4 in closed form for the output layer). Supported models: an
``nn.Sequential`` (nested ones are flattened) of ``Linear`` and ``Conv2d`` layers, each hidden
one followed by ``ReLU``, optionally ``Flatten`` at the start or between the convolutional and
the dense part; the last layer is a ``Linear``. Convolutions are handled through im2col
(Appendix C.1): ``unfold`` for the weight update and the layer's Toeplitz matrix for eq. (4).

Privacy: see :mod:`hidden_state_accountants.analyses.sbcd`,
:mod:`hidden_state_accountants.sbcd_training` (the checks, the schedule and the seed rule every
DP-SBCD trainer shares) and ``docs/dp_sbcd.md``. What this class makes true by construction:

* each example's contribution to the ``theta_d`` update has Frobenius norm ``<= gamma rho_d / 2``
  (its residual is scaled down), so replacing one record moves the batch mean by at most
  ``gamma rho_d / b``: the sensitivity ``S_g = gamma rho_d`` of Cor. 4.4;
* ``rho_d`` is the *effective* input norm of the weight update: ``sqrt(rho_x^2 + 1)`` with a bias,
  ``sqrt(kh kw rho_x^2 + L)`` for a convolution with ``L`` output positions (the Frobenius norm
  of the im2col matrix with its bias column); the event records these values;
* the batch partition is fixed, the noise schedule is evaluated without looking at the data,
  every batch has exactly ``b`` records;
* with ``seed=None`` the partition and the noise come from secret seeds drawn from the
  operating system (never from torch's global generator);
* for ``variant="appendix_c"``: the noise is added after the preconditioner, each example's data
  term is clipped and the block is projected onto a Frobenius ball (the sensitivity is then
  :func:`~hidden_state_accountants.analyses.sbcd.appendix_c_sensitivity`).

The epsilon: for a network of two or more blocks, the composition bound
(``dp_sbcd_composition``), a valid DP guarantee even if every iterate is released. The
hidden-state bound of Thm 4.5 is proved for one block only (a linear model): with more, each
block's step recomputes ``x_d``, ``u_d`` from its weights and is not the map the theorem is
proved for, so it is not applied (:mod:`hidden_state_accountants.analyses.sbcd`, docs/dp_sbcd.md,
"Audit").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from hidden_state_accountants import validation as v
from hidden_state_accountants.errors import UnsupportedLayerError
from hidden_state_accountants.schedules import SHUFFLE_PARTITION
from hidden_state_accountants.sbcd_training import SbcdTrainerBase

__all__ = ["DPSBCD", "UnsupportedLayerError", "parse_model", "MAX_TOEPLITZ_INPUTS"]

MAX_TOEPLITZ_INPUTS = 16384
"""Largest ``C*H*W`` input of a hidden convolution: eq. (4) solves one dense system of that size
per step (the Toeplitz form of Appendix C.1)."""


@dataclass
class _Block:
    """One weight block ``theta_d`` and the shapes around it."""

    module: nn.Module
    kind: str  # "linear" or "conv"
    in_shape: Tuple[int, ...] = ()  # per-example input shape (x_d)
    out_shape: Tuple[int, ...] = ()  # per-example output shape (u_d)
    flatten_before: bool = False

    @property
    def has_bias(self) -> bool:
        return self.module.bias is not None

    @property
    def in_features(self) -> int:
        return int(math.prod(self.in_shape))

    # conv helpers -------------------------------------------------------------
    def conv_kwargs(self):
        m = self.module
        return dict(stride=m.stride, padding=m.padding, dilation=m.dilation)

    @property
    def positions(self) -> int:
        """Output positions ``L`` of a convolution (1 for a dense layer)."""
        return int(math.prod(self.out_shape[1:])) if self.kind == "conv" else 1


def _flatten_modules(model: nn.Module) -> List[nn.Module]:
    if isinstance(model, nn.Sequential):
        out = []
        for m in model:
            out.extend(_flatten_modules(m))
        return out
    return [model]


def parse_model(model: nn.Module, example_shape: Sequence[int]) -> List[_Block]:
    """Splits ``model`` into weight blocks; raises :class:`UnsupportedLayerError` otherwise."""
    if not isinstance(model, nn.Sequential):
        raise UnsupportedLayerError(
            f"DP-SBCD needs an nn.Sequential of Linear/Conv2d + ReLU layers, got {type(model).__name__}"
        )
    mods = [m for m in _flatten_modules(model) if not isinstance(m, nn.Identity)]
    blocks: List[_Block] = []
    expect = "layer"  # what may come next: "layer", "relu" or "layer_or_flatten"
    pending_flatten = False
    shape = tuple(int(s) for s in example_shape)
    for i, m in enumerate(mods):
        name = f"{type(m).__name__} at position {i}"
        if isinstance(m, nn.Flatten):
            if m.start_dim != 1 or m.end_dim != -1:
                raise UnsupportedLayerError(f"{name}: only Flatten(start_dim=1, end_dim=-1) is supported")
            if expect == "relu" or pending_flatten:
                raise UnsupportedLayerError(f"{name}: Flatten must come first or right after a ReLU")
            pending_flatten = True
            shape = (int(math.prod(shape)),)
            continue
        if isinstance(m, nn.ReLU):
            if expect != "relu":
                raise UnsupportedLayerError(f"{name}: ReLU must follow a Linear or Conv2d layer")
            expect = "layer"
            continue
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            if expect == "relu":
                raise UnsupportedLayerError(
                    f"{name}: every hidden layer must be followed by ReLU (DP-SBCD's eq. 6 is for ReLU)"
                )
            if isinstance(m, nn.Linear):
                if len(shape) != 1:
                    raise UnsupportedLayerError(f"{name}: Linear needs flat input, got shape {shape}; add nn.Flatten()")
                if shape[0] != m.in_features:
                    raise UnsupportedLayerError(f"{name}: expects {m.in_features} inputs, gets {shape[0]}")
                out = (m.out_features,)
                kind = "linear"
            else:
                if len(shape) != 3:
                    raise UnsupportedLayerError(f"{name}: Conv2d needs (C, H, W) input, got shape {shape}")
                if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
                    raise UnsupportedLayerError(
                        f"{name}: only groups=1, padding_mode='zeros' and numeric padding are supported"
                    )
                if shape[0] != m.in_channels:
                    raise UnsupportedLayerError(f"{name}: expects {m.in_channels} channels, gets {shape[0]}")
                with torch.no_grad():
                    probe = m(torch.zeros((1,) + shape, dtype=m.weight.dtype, device=m.weight.device))
                out = tuple(int(s) for s in probe.shape[1:])
                kind = "conv"
            blocks.append(_Block(module=m, kind=kind, in_shape=shape, out_shape=out, flatten_before=pending_flatten))
            pending_flatten = False
            shape = out
            expect = "relu"
            continue
        raise UnsupportedLayerError(
            f"{name} is not supported; DP-SBCD supports Linear, Conv2d (PyTorch only), ReLU and Flatten"
        )
    if not blocks:
        raise UnsupportedLayerError("the model has no Linear or Conv2d layer")
    if expect != "relu":
        raise UnsupportedLayerError("the model must end with a layer (no ReLU or Flatten after the output layer)")
    if blocks[-1].kind != "linear":
        raise UnsupportedLayerError("the output layer must be Linear")
    for d in range(1, len(blocks)):
        if blocks[d].kind == "conv" and blocks[d - 1].kind == "linear":
            raise UnsupportedLayerError("a Conv2d after a Linear layer is not supported")
        if blocks[d].kind == "conv" and blocks[d].in_features > MAX_TOEPLITZ_INPUTS:
            raise UnsupportedLayerError(
                f"Conv2d layer {d} has {blocks[d].in_features} inputs (C*H*W); eq. (4) solves a dense "
                f"system of that size every step (Appendix C.1), supported up to {MAX_TOEPLITZ_INPUTS}"
            )
    return blocks


def _clip_rows(x: torch.Tensor, bound: float) -> torch.Tensor:
    """Eq. (5): each example scaled to norm ``<= bound``."""
    flat = x.reshape(x.shape[0], -1)
    norms = flat.norm(dim=1)
    scale = torch.clamp(bound / torch.clamp(norms, min=1e-30), max=1.0)
    return x * scale.view((-1,) + (1,) * (x.dim() - 1))


def u_update(a: torch.Tensor, x_next: torch.Tensor) -> torch.Tensor:
    """Eq. (6): ``argmin_u (x_next - relu(u))^2 + (u - a)^2`` element-wise, ``a = theta_d x_d``.

    Re-derived (the PDF's cases are garbled; Zeng et al. 2019, Lemma 13): on ``u <= 0`` the
    minimiser is ``min(a, 0)``, on ``u >= 0`` it is ``max((a + x_next)/2, 0)``; take the better.
    """
    u_neg = torch.clamp(a, max=0.0)
    c_neg = x_next * x_next + (u_neg - a) ** 2
    u_pos = torch.clamp((a + x_next) / 2.0, min=0.0)
    c_pos = (x_next - u_pos) ** 2 + (u_pos - a) ** 2
    return torch.where(c_neg <= c_pos, u_neg, u_pos)


def _refuse_distributed() -> None:
    """DP-SBCD runs in one process: it holds every record's auxiliary variables and updates
    them in place, and nothing here splits a batch across ranks, combines their updates or adds
    the noise once. Under ``torch.distributed`` with several ranks each would train (and add
    noise to) its own copy, which is not the accounted run: refuse instead of guessing."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise v.ParameterError(
            "distributed",
            f"DP-SBCD is not supported under torch.distributed with {dist.get_world_size()} "
            "processes (each would run and noise its own copy of the training, which is not the accounted "
            "run); train it in one process",
        )


class DPSBCD(torch.optim.Optimizer, SbcdTrainerBase):
    """DP-SBCD (Algorithm 2) on an ``nn.Sequential`` ReLU network, with its accountant.

    Args:
      model: ``nn.Sequential`` of ``Linear``/``Conv2d`` + ``ReLU`` (see module docstring).
      data: training inputs, a tensor ``(n, ...)`` matching the model's input.
      targets: class labels ``(n,)`` (one-hot encoded for the squared loss) or real targets
        ``(n, out_features)``.
      batch_size: ``b``; ``n // b`` batches per epoch, ``n mod b`` records are left out.
      step_size: ``eta`` (one value, or one per layer).
      noise: ``o(eta, k, j)``: a number, a
        :class:`~hidden_state_accountants.analyses.sbcd.NoiseSchedule` or a callable
        ``o(eta, k, j)``; the noise added to ``theta_d`` has variance ``2 eta o``. The schedule
        is called with ``eta`` = the (first) step size.
      rho: clipping threshold of ``x_d`` (eq. 5), one value or one per layer (``rho[0]`` clips
        the inputs).
      gamma: Lagrangian coefficient (paper: 1).
      regularizer: ``"none"``, ``"l2"`` or ``"l1"`` (proximal map on the whole block, bias
        included). Only ``"l2"`` (``regularization > 0``) makes the hidden-state bound converge.
      regularization: ``lambda`` (one value or one per layer).
      sampling: ``"shuffle_partition"`` or ``"cyclic"`` (``SHUFFLE_PARTITION`` / ``CYCLIC`` in
        :mod:`hidden_state_accountants.schedules`); at least two batches.
      variant: ``"proximal_gradient"`` (eq. 8) or ``"appendix_c"``.
      radius: Frobenius radius of each block (required for ``appendix_c``; optional otherwise).
      seed: ``None`` (the default) draws secret seeds for the partition and the noise from the
        operating system (:mod:`hidden_state_accountants.sbcd_training`); an integer in
        ``[0, 2**63)`` is your explicit choice for reproducible runs. It fixes the partition
        and the noise, so keep it as secret as the data (anyone who knows it can subtract the
        noise); :meth:`explain` notes it.
      device: where the auxiliary variables and the computation live (default: the model's).
      paper_assumptions: report the Thm 4.5 hidden-state bound where it is proved, a one-block
        model (``False``: composition only). With two or more blocks Thm 4.5 is not applied
        whatever this says, and ``True`` (the default) warns (``SbcdAssumptionWarning``) saying why.
    """

    def __init__(
        self,
        model: nn.Module,
        data: torch.Tensor,
        targets: torch.Tensor,
        *,
        batch_size: int,
        step_size,
        noise,
        rho=1.0,
        gamma: float = 1.0,
        regularizer: str = "none",
        regularization=0.0,
        sampling: str = SHUFFLE_PARTITION,
        variant: str = "proximal_gradient",
        radius=None,
        seed: Optional[int] = None,
        device=None,
        paper_assumptions: bool = True,
    ):
        _refuse_distributed()
        if not isinstance(data, torch.Tensor) or data.dim() < 2:
            raise v.ParameterError("data", "must be a tensor of shape (n, ...)")
        n = int(data.shape[0])
        self._check_options(n, batch_size, sampling, regularizer, variant, gamma, seed)
        blocks = parse_model(model, data.shape[1:])
        self.blocks = blocks
        self.model = model
        self._set_layer_hyperparameters(len(blocks), step_size, rho, regularization, radius, noise, paper_assumptions)
        self.rho_eff = [self._effective_rho(blk, r) for blk, r in zip(blocks, self.rho_x)]
        self._warn_expansive_steps()
        self.device = torch.device(device) if device is not None else blocks[0].module.weight.device
        self.dtype = blocks[0].module.weight.dtype
        model.to(self.device)
        params = [p for blk in blocks for p in blk.module.parameters()]
        super().__init__(params, defaults=dict(lr=self.step_sizes[0]))

        gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        self._gen = torch.Generator(device=gen_device)
        self._gen.manual_seed(self.noise_seed)
        # drawn once by the core's schedule, visited in order every epoch
        self.partition = torch.as_tensor(self.batch_schedule.partition(), dtype=torch.long, device=self.device)

        # targets
        out_features = blocks[-1].module.out_features
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0 or targets.shape[0] != n:
            raise v.ParameterError("targets", f"must be a tensor with {n} rows (one per record)")
        targets = targets.to(self.device)
        if targets.dim() == 1 and not torch.is_floating_point(targets):
            if int(targets.min()) < 0 or int(targets.max()) >= out_features:
                raise v.ParameterError("targets", f"class labels must lie in [0, {out_features - 1}]")
            y = torch.nn.functional.one_hot(targets.long(), out_features).to(self.dtype)
        else:
            y = targets.to(self.dtype).reshape(n, -1)
            if y.shape[1] != out_features:
                raise v.ParameterError("targets", f"needs {out_features} values per record, got {y.shape[1]}")
        self.targets = y

        # auxiliary variables: x[0] (clipped inputs), x[d], u[d]; initialised by a forward pass
        with torch.no_grad():
            if self.radius is not None:
                for d, blk in enumerate(blocks):
                    self._set_theta(blk, self._project(self._theta(blk), self.radius[d]))
            x = _clip_rows(data.to(self.device, self.dtype), self.rho_x[0]).reshape((n,) + blocks[0].in_shape)
            self.xs: List[torch.Tensor] = [x]
            self.us: List[torch.Tensor] = []
            for d in range(self.num_layers - 1):
                u = self._chunked_forward(blocks[d], self.xs[d])
                self.us.append(u)
                nxt = torch.relu(u).reshape((n,) + blocks[d + 1].in_shape)
                self.xs.append(_clip_rows(nxt, self.rho_x[d + 1]))
        self._t = 0
        self._noise_history: List[float] = []

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _effective_rho(blk: _Block, rho_x: float) -> float:
        """Bound on the norm of the per-example input of the weight update (module docstring)."""
        if blk.kind == "linear":
            return math.sqrt(rho_x * rho_x + (1.0 if blk.has_bias else 0.0))
        kh, kw = blk.module.kernel_size
        return math.sqrt(kh * kw * rho_x * rho_x + (blk.positions if blk.has_bias else 0.0))

    def _chunked_forward(self, blk: _Block, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        return torch.cat([blk.module(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)])

    @staticmethod
    def _theta(blk: _Block) -> torch.Tensor:
        """``[W | b]`` with the kernel flattened: ``(out, in_features (+1))``."""
        w = blk.module.weight.detach()
        w = w.reshape(w.shape[0], -1)
        if blk.has_bias:
            w = torch.cat([w, blk.module.bias.detach()[:, None]], dim=1)
        return w

    @staticmethod
    def _set_theta(blk: _Block, theta: torch.Tensor) -> None:
        m = blk.module
        k = m.weight[0].numel()
        m.weight.data.copy_(theta[:, :k].reshape(m.weight.shape))
        if blk.has_bias:
            m.bias.data.copy_(theta[:, k])

    @staticmethod
    def _project(theta: torch.Tensor, radius: float) -> torch.Tensor:
        norm = theta.norm()
        return theta * torch.clamp(radius / torch.clamp(norm, min=1e-30), max=1.0)

    def _patches(self, blk: _Block, x: torch.Tensor) -> torch.Tensor:
        """Per-example input of the weight update: ``(B, L, k)`` (``L = 1`` for dense), with the
        bias column of ones when the layer has a bias (im2col for a convolution, App. C.1)."""
        bsz = x.shape[0]
        if blk.kind == "linear":
            p = x.reshape(bsz, 1, -1)
        else:
            m = blk.module
            p = torch.nn.functional.unfold(x, m.kernel_size, **self.conv_unfold_kwargs(m)).transpose(1, 2)
        if blk.has_bias:
            p = torch.cat([p, torch.ones(p.shape[0], p.shape[1], 1, dtype=p.dtype, device=p.device)], dim=2)
        return p

    @staticmethod
    def conv_unfold_kwargs(m: nn.Conv2d):
        return dict(dilation=m.dilation, padding=m.padding, stride=m.stride)

    @staticmethod
    def _as_rows(blk: _Block, u: torch.Tensor) -> torch.Tensor:
        """``u`` (B, *out_shape) as (B, L, out) to match :meth:`_patches`."""
        bsz = u.shape[0]
        if blk.kind == "linear":
            return u.reshape(bsz, 1, -1)
        return u.reshape(bsz, u.shape[1], -1).transpose(1, 2)

    def _toeplitz(self, blk: _Block) -> torch.Tensor:
        """The convolution (without bias) as a matrix ``(out_dim, in_dim)`` (App. C.1)."""
        m = blk.module
        n_in = blk.in_features
        eye = torch.eye(n_in, dtype=self.dtype, device=self.device).reshape((n_in,) + blk.in_shape)
        cols = torch.nn.functional.conv2d(eye, m.weight.detach(), None, **blk.conv_kwargs())
        return cols.reshape(n_in, -1).T

    def _x_update(self, d: int, prev_act: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Eq. (4): ``argmin_x ||x - relu(u_{d-1})||^2 + ||target - theta_d x - b_d||^2``
        (``target = u_d``, or ``y`` for the output layer, where ``R = gamma/2 ||z - y||^2`` makes
        the same closed form exact; the PDF's ``Prox_{1/2,R}`` is that minimiser)."""
        blk = self.blocks[d]
        m = blk.module
        bsz = prev_act.shape[0]
        resid = target
        if blk.has_bias:
            bias = m.bias.detach()
            resid = target - (bias if blk.kind == "linear" else bias.view(-1, 1, 1))
        if blk.kind == "linear":
            w = m.weight.detach()  # (out, in)
            rhs = prev_act.reshape(bsz, -1) + resid.reshape(bsz, -1) @ w
            a = torch.eye(w.shape[1], dtype=w.dtype, device=w.device) + w.T @ w
        else:
            t = self._toeplitz(blk)  # (out_dim, in_dim)
            rhs = prev_act.reshape(bsz, -1) + resid.reshape(bsz, -1) @ t
            a = torch.eye(t.shape[1], dtype=t.dtype, device=t.device) + t.T @ t
        chol = torch.linalg.cholesky(a)
        x = torch.cholesky_solve(rhs.T, chol).T
        return x.reshape((bsz,) + blk.in_shape)

    def _prox(self, theta: torch.Tensor, d: int) -> torch.Tensor:
        eta, lam = self.step_sizes[d], self.lambdas[d]
        if self.regularizer == "l2":
            theta = theta / (1.0 + eta * lam)
        elif self.regularizer == "l1":
            theta = torch.sign(theta) * torch.clamp(theta.abs() - eta * lam, min=0.0)
        if self.radius is not None:
            theta = self._project(theta, self.radius[d])
        return theta

    def _noise_like(self, theta: torch.Tensor, var: float) -> torch.Tensor:
        z = torch.randn(theta.shape, generator=self._gen, device=self._gen.device, dtype=theta.dtype)
        return z.to(theta.device) * math.sqrt(var)

    def per_example_contributions(self, d: int, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each example's clipped contribution to layer ``d``'s update, ``(B, out, k)``.

        ``proximal_gradient``: ``gamma s_i R_i^T P_i``, the clipped gradient of
        ``gamma/2 ||P_i theta^T - U_i||^2`` (``s_i`` scales the residual ``R_i`` so the norm is
        ``<= gamma rho / 2``; a Huber gradient, so still convex and ``gamma rho^2``-smooth).
        ``appendix_c``: the data term ``gamma t_i U_i^T P_i``, clipped likewise. For tests; the
        update itself never materialises this tensor.
        """
        blk = self.blocks[d]
        p = self._patches(blk, x)
        u = self._as_rows(blk, target)
        scaled = self._clipped_rows(d, p, u)
        return self.gamma * torch.einsum("blo,blk->bok", scaled, p)

    def _clipped_rows(self, d: int, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        blk = self.blocks[d]
        theta = self._theta(blk)
        if self.variant == "proximal_gradient":
            r = torch.einsum("blk,ok->blo", p, theta) - u  # residual P theta^T - U
        else:
            r = u
        bound = self.rho_eff[d] / 2.0
        # ||R||_F ||P||_F >= ||R^T P||_F. Not the gradient's own norm ||R^T P||_F: R is then projected onto a
        # ball whose radius does not depend on theta, so the clipped field is a (Huber) gradient and the
        # sub-problem stays convex; for a convolution the own-norm clip is not (docs/dp_sbcd.md, "Audit").
        norm = r.flatten(1).norm(dim=1) * p.flatten(1).norm(dim=1)
        scale = torch.clamp(bound / torch.clamp(norm, min=1e-30), max=1.0)
        # float rounding must not push a contribution over the bound
        scale = scale * (1.0 - 4 * torch.finfo(p.dtype).eps)
        return r * scale.view(-1, 1, 1)

    def _theta_update(self, d: int, x: torch.Tensor, target: torch.Tensor, o: float) -> None:
        blk = self.blocks[d]
        eta, b, gamma = self.step_sizes[d], self.batch_size, self.gamma
        p = self._patches(blk, x)
        rows = self._clipped_rows(d, p, self._as_rows(blk, target))
        term = (gamma / b) * torch.einsum("blo,blk->ok", rows, p)  # mean of clipped contributions
        theta = self._theta(blk)
        if self.variant == "proximal_gradient":
            new = theta - eta * term  # term is the mean clipped gradient
        else:
            # Appendix C: (theta + eta A)(I + eta Sigma)^{-1}, Sigma = (gamma/b) sum P_i^T P_i
            sigma = (gamma / b) * torch.einsum("blk,blm->km", p, p)
            a = torch.eye(sigma.shape[0], dtype=sigma.dtype, device=sigma.device) + eta * sigma
            chol = torch.linalg.cholesky(a)
            new = torch.cholesky_solve((theta + eta * term).T, chol).T
        new = new + self._noise_like(new, 2.0 * eta * o)
        self._set_theta(blk, self._prox(new, d))

    # --------------------------------------------------------------- training
    @property
    def steps_done(self) -> int:
        return self._t

    @property
    def epochs_done(self) -> float:
        return self._t / self.steps_per_epoch

    def discard_auxiliary(self) -> nn.Module:
        """Deletes the per-example auxiliary variables and returns the model.

        ``xs`` / ``us`` are *unnoised* functions of each training record: they are not covered by
        any privacy guarantee and must never be saved, logged or released. Call this when
        training is over (the optimizer cannot step afterwards).
        """
        self.xs, self.us = None, None
        return self.model

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        """One mini-batch of Algorithm 2: every layer's ``x_d``, ``u_d`` and ``theta_d``."""
        if self.xs is None:
            raise RuntimeError("the auxiliary variables were discarded; DP-SBCD cannot continue")
        if closure is not None:
            raise ValueError("closure: DP-SBCD does not use gradients; call step() without a closure")
        for g in self.param_groups:
            if g["lr"] != self.step_sizes[0]:
                raise ValueError("lr: DP-SBCD's step size is fixed at construction (the accountant uses it)")
        _refuse_distributed()
        t = self._t
        o = self._noise_at(t)
        idx = self.partition[t % self.steps_per_epoch]
        blocks, layers = self.blocks, self.num_layers
        x = self.xs[0][idx]
        for d in range(layers):
            if d >= 1:
                prev = torch.relu(self.us[d - 1][idx]).reshape((len(idx),) + blocks[d].in_shape)
                target = self.us[d][idx] if d < layers - 1 else self.targets[idx]
                x = _clip_rows(self._x_update(d, prev, target), self.rho_x[d])
                self.xs[d][idx] = x
            if d < layers - 1:
                a = blocks[d].module(x)
                x_next = self.xs[d + 1][idx].reshape(a.shape)
                u = u_update(a, x_next)
                self.us[d][idx] = u
                self._theta_update(d, x, u, o)
            else:
                self._theta_update(d, x, self.targets[idx], o)
        self._noise_history.append(o)
        self._t += 1
        return None

    # ------------------------------------------------------------ inference
    @torch.no_grad()
    def predict(self, data: torch.Tensor) -> torch.Tensor:
        """The model's output on ``data`` with the training's input clipping (``rho[0]``)."""
        x = _clip_rows(data.to(self.device, self.dtype), self.rho_x[0])
        return self.model(x)

    @torch.no_grad()
    def objective(self) -> float:
        """The Lagrangian (eq. 3) averaged over the partitioned records, at the current state.

        A diagnostic computed from the unnoised auxiliary variables: it is *not* private.
        """
        idx = self.partition.reshape(-1)
        total = 0.0
        for d, blk in enumerate(self.blocks):
            a = blk.module(self.xs[d][idx])
            if d < self.num_layers - 1:
                total += float(((self.us[d][idx] - a) ** 2).sum())
                nxt = self.xs[d + 1][idx].reshape(a.shape)
                total += float(((nxt - torch.relu(self.us[d][idx])) ** 2).sum())
            else:
                total += float(((a - self.targets[idx]) ** 2).sum())
        return self.gamma / 2.0 * total / len(idx)
