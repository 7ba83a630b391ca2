"""DP-SBCD for Keras (TensorFlow 2, Keras 2): block coordinate descent for ReLU networks.

Import as ``hidden_state_accountants.keras.sbcd`` (needs TensorFlow, not TF-Privacy;
``hidden_state_accountants.tf_privacy.sbcd`` is the same module under its former name).

>>> import numpy as np, tensorflow as tf
>>> from hidden_state_accountants.keras.sbcd import DPSBCD
>>> model = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(10)])
>>> X = np.random.randn(600, 64).astype("float32"); y = np.random.randint(0, 10, 600)
>>> opt = DPSBCD(model, X, y, batch_size=200, step_size=0.5, noise=1e-3, regularizer="l2",
...              regularization=0.05)
>>> opt.seed_is_secret  # no seed given: the partition and the noise come from a secret draw
True
>>> _ = opt.fit(epochs=2, progress=False)
>>> eps = opt.get_epsilon(1e-5)

The same algorithm as the PyTorch optimizer (``hidden_state_accountants.pytorch.sbcd``; read its
docstring for the update rules and what is enforced): Algorithm 2 of *Differentially Private
Network Training under Hidden State Assumption* (ICLR 2025 submission, arXiv:2407.08233) with
the closed-form ``x_d`` (eq. 4), clipping (eq. 5), ``u_d`` (eq. 6) and the noisy proximal
``theta_d`` step (eq. 8) or the Appendix C variant, on the squared loss. It is a trainer rather
than a ``tf.keras.optimizers.Optimizer``: DP-SBCD does not consume gradients, and it must own the
per-example auxiliary variables and the fixed batch partition.

Supported models: ``tf.keras.Sequential`` of ``Dense`` layers (``activation`` ``"relu"`` or
``None``/``"linear"``, or followed by a ``ReLU`` / ``Activation("relu")`` layer), optionally
``Flatten`` first; the last ``Dense`` is linear; float32 or float64 weights (the trainer computes
in the model's type). Convolutions are supported by the PyTorch optimizer only. Runs on CPU or
GPU (wherever TensorFlow places the variables), on one device: a model built under a
``tf.distribute`` strategy with several replicas is refused (the trainer is its own loop and does
not split its steps over replicas).

The checks, the batch partition (the core's
:class:`~hidden_state_accountants.schedules.BatchSchedule`) and the seed rule are those of every
DP-SBCD trainer (:mod:`hidden_state_accountants.sbcd_training`): ``seed=None`` draws secret
seeds for the partition and the noise (never TensorFlow's global seed); a given seed is your
explicit choice and must be kept as secret as the data.
"""

from __future__ import annotations

import math
from typing import List, Optional

import numpy as np
import tensorflow as tf

from hidden_state_accountants import validation as v
from hidden_state_accountants.errors import UnsupportedLayerError
from hidden_state_accountants.schedules import SHUFFLE_PARTITION
from hidden_state_accountants.sbcd_training import SbcdTrainerBase

__all__ = ["DPSBCD", "UnsupportedLayerError", "parse_model"]


def _is_relu_activation(act) -> bool:
    return act is tf.keras.activations.relu or getattr(act, "__name__", "") == "relu"


def _is_linear_activation(act) -> bool:
    return act is None or act is tf.keras.activations.linear or getattr(act, "__name__", "") == "linear"


def parse_model(model, input_dim: int) -> List[tf.keras.layers.Dense]:
    """The model's ``Dense`` blocks; raises :class:`UnsupportedLayerError` for anything else."""
    if not isinstance(model, tf.keras.Sequential):
        raise UnsupportedLayerError(
            f"DP-SBCD needs a tf.keras.Sequential of Dense + ReLU layers, got {type(model).__name__}"
        )
    for i, layer in enumerate(model.layers):  # unsupported types first, before building
        if isinstance(layer, tf.keras.layers.Conv2D):
            raise UnsupportedLayerError(
                f"Conv2D '{layer.name}' at position {i}: Conv2D is supported by the PyTorch optimizer only"
            )
    if not model.built:
        model.build((None, input_dim))
    dense: List[tf.keras.layers.Dense] = []
    expect = "layer"
    for i, layer in enumerate(model.layers):
        name = f"{type(layer).__name__} '{layer.name}' at position {i}"
        if isinstance(layer, tf.keras.layers.InputLayer):
            continue
        if isinstance(layer, tf.keras.layers.Flatten):
            if dense:
                raise UnsupportedLayerError(f"{name}: Flatten is only supported as the first layer")
            continue
        if isinstance(layer, tf.keras.layers.ReLU) or (
            isinstance(layer, tf.keras.layers.Activation) and _is_relu_activation(layer.activation)
        ):
            if isinstance(layer, tf.keras.layers.ReLU) and (
                layer.max_value is not None or float(layer.negative_slope) != 0.0 or float(layer.threshold) != 0.0
            ):
                raise UnsupportedLayerError(f"{name}: only the plain ReLU is supported")
            if expect != "relu":
                raise UnsupportedLayerError(f"{name}: ReLU must follow a linear Dense layer")
            expect = "layer"
            continue
        if isinstance(layer, tf.keras.layers.Dense):
            if expect == "relu":
                raise UnsupportedLayerError(f"{name}: every hidden Dense layer must be followed by ReLU")
            dense.append(layer)
            if _is_relu_activation(layer.activation):
                expect = "layer"
            elif _is_linear_activation(layer.activation):
                expect = "relu"
            else:
                raise UnsupportedLayerError(f"{name}: activation must be 'relu' or linear")
            continue
        if isinstance(layer, tf.keras.layers.Conv2D):
            raise UnsupportedLayerError(f"{name}: Conv2D is supported by the PyTorch optimizer only")
        raise UnsupportedLayerError(f"{name} is not supported; DP-SBCD supports Dense, ReLU and Flatten")
    if not dense:
        raise UnsupportedLayerError("the model has no Dense layer")
    if expect != "relu":
        raise UnsupportedLayerError("the output layer must be a Dense layer without activation")
    return dense


def _check_one_device(model) -> None:
    """DP-SBCD's trainer is its own loop on one device: it does not split its steps over the
    replicas of a ``tf.distribute`` strategy (each worker would run a run of its own)."""
    strategy = getattr(model, "distribute_strategy", None)
    replicas = int(getattr(strategy, "num_replicas_in_sync", 1))
    if (
        replicas > 1
        or tf.distribute.in_cross_replica_context()
        and tf.distribute.has_strategy()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    ):
        name = type(strategy if replicas > 1 else tf.distribute.get_strategy()).__name__
        raise UnsupportedLayerError(
            f"the model was built under {name}: DP-SBCD's Keras trainer runs on one device and does not split its "
            "steps over replicas; build the model outside the strategy's scope (the run is then one device's, "
            "as accounted)"
        )


def _model_dtype(layers) -> tf.DType:
    """The float type every ``Dense`` kernel shares (float32, or float64 for a model built with
    ``dtype="float64"``); the trainer computes in it."""
    dtypes = {layer.kernel.dtype for layer in layers}
    if len(dtypes) != 1 or not dtypes <= {tf.float32, tf.float64}:
        raise UnsupportedLayerError(
            f"every Dense layer must hold float32 or float64 weights, all the same; got {sorted(d.name for d in dtypes)}"
        )
    return dtypes.pop()


def _clip_rows(x: tf.Tensor, bound: float) -> tf.Tensor:
    norms = tf.norm(x, axis=1, keepdims=True)
    return x * tf.minimum(bound / tf.maximum(norms, 1e-30), 1.0)


def u_update(a: tf.Tensor, x_next: tf.Tensor) -> tf.Tensor:
    """Eq. (6), re-derived: element-wise ``argmin_u (x_next - relu(u))^2 + (u - a)^2``."""
    u_neg = tf.minimum(a, 0.0)
    c_neg = x_next * x_next + (u_neg - a) ** 2
    u_pos = tf.maximum((a + x_next) / 2.0, 0.0)
    c_pos = (x_next - u_pos) ** 2 + (u_pos - a) ** 2
    return tf.where(c_neg <= c_pos, u_neg, u_pos)


class DPSBCD(SbcdTrainerBase):
    """DP-SBCD (Algorithm 2) on a Keras ``Sequential`` ReLU MLP, with its accountant.

    Arguments as for the PyTorch ``DPSBCD`` (``hidden_state_accountants.pytorch.sbcd``):
    ``model, data, targets, batch_size, step_size, noise, rho, gamma, regularizer,
    regularization, sampling, variant, radius, seed, paper_assumptions``. ``seed=None`` (the
    default) draws secret seeds; an integer is your explicit choice, to be kept secret.
    """

    _progress_label = "DP-SBCD (Keras)"

    def __init__(
        self,
        model,
        data,
        targets,
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
        paper_assumptions: bool = True,
    ):
        data = np.asarray(data)
        if data.ndim < 2:
            raise v.ParameterError("data", "must be an array of shape (n, ...)")
        n = int(data.shape[0])
        data = data.reshape(n, -1)
        self._check_options(n, batch_size, sampling, regularizer, variant, gamma, seed)
        self.model = model
        self.layers = parse_model(model, data.shape[1])
        _check_one_device(model)
        self.dtype = _model_dtype(self.layers)
        data = data.astype(self.dtype.as_numpy_dtype)
        if self.layers[0].kernel.shape[0] != data.shape[1]:
            raise v.ParameterError(
                "data", f"the model expects {self.layers[0].kernel.shape[0]} features, got {data.shape[1]}"
            )
        self._set_layer_hyperparameters(
            len(self.layers), step_size, rho, regularization, radius, noise, paper_assumptions
        )
        self.has_bias = [layer.use_bias for layer in self.layers]
        self.rho_eff = [math.sqrt(r * r + (1.0 if hb else 0.0)) for r, hb in zip(self.rho_x, self.has_bias)]
        self._warn_expansive_steps()
        self._gen = tf.random.Generator.from_seed(self.noise_seed)
        # drawn once by the core's schedule, visited in order every epoch
        self.partition = tf.constant(self.batch_schedule.partition(), dtype=tf.int32)

        out_features = int(self.layers[-1].kernel.shape[1])
        targets = np.asarray(targets)
        if targets.ndim == 0 or targets.shape[0] != n:
            raise v.ParameterError("targets", f"must have {n} rows (one per record)")
        if targets.ndim == 1 and np.issubdtype(targets.dtype, np.integer):
            if targets.min() < 0 or targets.max() >= out_features:
                raise v.ParameterError("targets", f"class labels must lie in [0, {out_features - 1}]")
            y = np.eye(out_features, dtype=self.dtype.as_numpy_dtype)[targets]
        else:
            y = targets.astype(self.dtype.as_numpy_dtype).reshape(len(targets), -1)
            if y.shape[1] != out_features:
                raise v.ParameterError("targets", f"needs {out_features} values per record, got {y.shape[1]}")
        self.targets = tf.constant(y)

        if self.radius is not None:
            for d in range(self.num_layers):
                self._set_theta(d, self._project(self._theta(d), self.radius[d]))
        x0 = _clip_rows(tf.constant(data), self.rho_x[0])
        self.xs: List[tf.Variable] = [tf.Variable(x0, trainable=False)]
        self.us: List[tf.Variable] = []
        for d in range(self.num_layers - 1):
            u = self._linear(d, self.xs[d])
            self.us.append(tf.Variable(u, trainable=False))
            self.xs.append(tf.Variable(_clip_rows(tf.nn.relu(u), self.rho_x[d + 1]), trainable=False))
        self._t = 0
        self._noise_history: List[float] = []
        self._compiled = tf.function(self._step_impl, reduce_retracing=True)

    # --------------------------------------------------------------- helpers
    def _linear(self, d: int, x):
        layer = self.layers[d]
        out = tf.matmul(x, layer.kernel)
        if layer.use_bias:
            out = out + layer.bias
        return out

    def _theta(self, d: int) -> tf.Tensor:
        """``[W | b]`` as ``(out, in (+1))`` (the kernel transposed)."""
        layer = self.layers[d]
        w = tf.transpose(layer.kernel)
        if layer.use_bias:
            w = tf.concat([w, layer.bias[:, None]], axis=1)
        return w

    def _set_theta(self, d: int, theta) -> None:
        layer = self.layers[d]
        k = int(layer.kernel.shape[0])
        layer.kernel.assign(tf.transpose(theta[:, :k]))
        if layer.use_bias:
            layer.bias.assign(theta[:, k])

    @staticmethod
    def _project(theta, radius: float):
        return theta * tf.minimum(radius / tf.maximum(tf.norm(theta), 1e-30), 1.0)

    def _patches(self, d: int, x):
        if self.has_bias[d]:
            x = tf.concat([x, tf.ones([tf.shape(x)[0], 1], dtype=x.dtype)], axis=1)
        return x

    def _clipped_rows(self, d: int, p, target):
        if self.variant == "proximal_gradient":
            r = tf.matmul(p, self._theta(d), transpose_b=True) - target
        else:
            r = target
        norm = tf.norm(r, axis=1) * tf.norm(p, axis=1)  # = the gradient's norm (rank one); see the PyTorch trainer
        scale = tf.minimum((self.rho_eff[d] / 2.0) / tf.maximum(norm, 1e-30), 1.0) * (
            1.0 - 4 * np.finfo(self.dtype.as_numpy_dtype).eps
        )
        return r * scale[:, None]

    def per_example_contributions(self, d: int, x, target):
        """Each example's clipped contribution to layer ``d``'s update, ``(B, out, k)`` (tests)."""
        p = self._patches(d, tf.convert_to_tensor(x))
        rows = self._clipped_rows(d, p, tf.convert_to_tensor(target))
        return self.gamma * tf.einsum("bo,bk->bok", rows, p)

    def _x_update(self, d: int, prev_act, target):
        """Eq. (4): ``(I + W W^T)^{-1}``-solve in Keras' ``x @ kernel`` orientation."""
        layer = self.layers[d]
        k = layer.kernel  # (in, out)
        resid = target - layer.bias if layer.use_bias else target
        rhs = prev_act + tf.matmul(resid, k, transpose_b=True)  # (B, in)
        a = tf.eye(int(k.shape[0]), dtype=self.dtype) + tf.matmul(k, k, transpose_b=True)
        chol = tf.linalg.cholesky(a)
        return tf.transpose(tf.linalg.cholesky_solve(chol, tf.transpose(rhs)))

    def _prox(self, d: int, theta):
        eta, lam = self.step_sizes[d], self.lambdas[d]
        if self.regularizer == "l2":
            theta = theta / (1.0 + eta * lam)
        elif self.regularizer == "l1":
            theta = tf.sign(theta) * tf.maximum(tf.abs(theta) - eta * lam, 0.0)
        if self.radius is not None:
            theta = self._project(theta, self.radius[d])
        return theta

    def _theta_update(self, d: int, x, target, o):
        eta, b, gamma = self.step_sizes[d], float(self.batch_size), self.gamma
        p = self._patches(d, x)
        rows = self._clipped_rows(d, p, target)
        term = (gamma / b) * tf.matmul(rows, p, transpose_a=True)  # (out, k)
        theta = self._theta(d)
        if self.variant == "proximal_gradient":
            new = theta - eta * term
        else:
            sigma = (gamma / b) * tf.matmul(p, p, transpose_a=True)
            a = tf.eye(int(sigma.shape[0]), dtype=self.dtype) + eta * sigma
            chol = tf.linalg.cholesky(a)
            new = tf.transpose(tf.linalg.cholesky_solve(chol, tf.transpose(theta + eta * term)))
        new = new + self._gen.normal(tf.shape(new), dtype=self.dtype) * tf.sqrt(tf.cast(2.0 * eta * o, self.dtype))
        self._set_theta(d, self._prox(d, new))

    def _step_impl(self, idx, o):
        x = tf.gather(self.xs[0], idx)
        last = self.num_layers - 1
        for d in range(self.num_layers):
            if d >= 1:
                prev = tf.nn.relu(tf.gather(self.us[d - 1], idx))
                target = tf.gather(self.us[d], idx) if d < last else tf.gather(self.targets, idx)
                x = _clip_rows(self._x_update(d, prev, target), self.rho_x[d])
                self.xs[d].scatter_nd_update(idx[:, None], x)
            if d < last:
                a = self._linear(d, x)
                u = u_update(a, tf.gather(self.xs[d + 1], idx))
                self.us[d].scatter_nd_update(idx[:, None], u)
                self._theta_update(d, x, u, o)
            else:
                self._theta_update(d, x, tf.gather(self.targets, idx), o)

    # --------------------------------------------------------------- training
    @property
    def steps_done(self) -> int:
        return self._t

    def discard_auxiliary(self):
        """Deletes the per-example auxiliary variables (unnoised functions of each record: never
        save or release them) and returns the model; the optimizer cannot step afterwards."""
        self.xs, self.us = None, None
        self._compiled = None
        return self.model

    def step(self) -> None:
        """One mini-batch of Algorithm 2 (every layer's ``x_d``, ``u_d``, ``theta_d``)."""
        if self.xs is None:
            raise RuntimeError("the auxiliary variables were discarded; DP-SBCD cannot continue")
        t = self._t
        o = self._noise_at(t)
        self._compiled(self.partition[t % self.steps_per_epoch], tf.constant(o, dtype=self.dtype))
        self._noise_history.append(o)
        self._t += 1

    def predict(self, data) -> np.ndarray:
        """The model's output with the training's input clipping (``rho[0]``)."""
        x = _clip_rows(
            tf.constant(np.asarray(data, dtype=self.dtype.as_numpy_dtype).reshape(len(data), -1)), self.rho_x[0]
        )
        return self.model(x, training=False).numpy()

    def objective(self) -> float:
        """The Lagrangian (eq. 3) on the auxiliary variables: a diagnostic, *not* private."""
        idx = tf.reshape(self.partition, [-1])
        total = 0.0
        for d in range(self.num_layers):
            a = self._linear(d, tf.gather(self.xs[d], idx))
            if d < self.num_layers - 1:
                u = tf.gather(self.us[d], idx)
                total += float(tf.reduce_sum((u - a) ** 2))
                total += float(tf.reduce_sum((tf.gather(self.xs[d + 1], idx) - tf.nn.relu(u)) ** 2))
            else:
                total += float(tf.reduce_sum((a - tf.gather(self.targets, idx)) ** 2))
        return self.gamma / 2.0 * total / int(idx.shape[0])
