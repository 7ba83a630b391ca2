"""The feature bound in Keras: enforced by :class:`FeatureClip`, or checked by :func:`largest_input_norm`.

* :class:`FeatureClip` scales every input to L2 norm ``<= R``, the feature bound of
  :meth:`LossGeometry.logistic_regression <hidden_state_accountants.LossGeometry.logistic_regression>`;
  put it right before the trainable ``Dense`` layer. :func:`feeding_clip_norm` finds it in the
  model's data flow (the TF-Privacy callback then takes the bound as *enforced*);
  :func:`clip_feature_norms` does the same to arrays.
* :func:`largest_input_norm` computes the inputs of the trainable layer on the data ``fit`` trains
  on (running the layers before it as in training), for the core to *check* before any step.

Sequential and functional models are read; a subclassed model's ``call`` is custom code, where
nothing is found for sure.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import numpy as np
import tensorflow as tf

from hidden_state_accountants import validation as v
from hidden_state_accountants.projection import inside_factor

from .projection import dtype_eps

ArrayLike = Union[np.ndarray, tf.Tensor, list]


class FeatureClip(tf.keras.layers.Layer):
    """A parameter-free layer that scales each example (all dimensions but the first) to L2 norm
    ``<= max_norm``: put it right before the trainable ``Dense`` layer so the feature bound of
    :meth:`LossGeometry.logistic_regression <hidden_state_accountants.LossGeometry.logistic_regression>`
    holds for every input, in training and after. The norm is computed in float64 and rows are
    scaled a hair inside the ball (:func:`~hidden_state_accountants.projection.inside_factor`), so
    rounding cannot leave one above ``max_norm``.

    >>> import numpy as np
    >>> float(np.linalg.norm(FeatureClip(2.0)(np.ones((1, 16), np.float32)))) <= 2.0
    True
    """

    def __init__(self, max_norm: float, **kwargs):
        super().__init__(**kwargs)
        self._max_norm = v.positive_float("max_norm", max_norm)

    @property
    def max_norm(self) -> float:
        """The radius (fixed: the callback reads it from the model's structure)."""
        return self._max_norm

    def call(self, inputs):
        x = tf.convert_to_tensor(inputs)
        norms = tf.norm(tf.reshape(tf.cast(x, tf.float64), [tf.shape(x)[0], -1]), axis=1)
        inside = inside_factor(dtype_eps(x.dtype))  # more margin where the dtype rounds coarser
        scale = tf.minimum(tf.constant(1.0, tf.float64), self._max_norm * inside / tf.maximum(norms, 1e-300))
        shape = tf.concat([[-1], tf.ones([tf.rank(x) - 1], tf.int32)], axis=0)
        return x * tf.cast(tf.reshape(scale, shape), x.dtype)

    def get_config(self):
        return {**super().get_config(), "max_norm": self._max_norm}


def largest_row_norm(features: ArrayLike) -> float:
    """The largest L2 norm of a record of ``features`` (all dimensions but the first), in float64
    (``nan`` if a record holds NaN; 0 for no record)."""
    x = np.asarray(features)
    rows = x.reshape(len(x), -1).astype(np.float64) if x.ndim else x.reshape(1, 1).astype(np.float64)
    return float(np.sqrt(np.max(np.einsum("ij,ij->i", rows, rows)))) if len(rows) else 0.0


def clip_feature_norms(features: ArrayLike, max_norm: float) -> np.ndarray:
    """Rescales each row of ``features`` to L2 norm at most ``max_norm`` (``||x|| <= R``).

    The logistic-regression geometry (:meth:`LossGeometry.logistic_regression`) needs
    ``||x|| <= R`` for every record; this makes it true.
    """
    r = v.positive_float("max_norm", max_norm)
    x = np.asarray(features, dtype=np.float64)
    flat = x.reshape(len(x), -1)
    norms = np.linalg.norm(flat, axis=1)
    # a hair inside the ball, so float32 rounding cannot push a row past r
    scale = np.minimum(1.0, r * inside_factor(float(np.finfo(np.float32).eps)) / np.maximum(norms, 1e-300))
    return (flat * scale[:, None]).reshape(x.shape).astype(np.float32)


_INPUT = "the model's input"  # marks "fed by the model's input, unchanged" in _feeding


def _leaf_layers(model) -> List[tf.keras.layers.Layer]:
    out = []
    for layer in model.layers:
        out += _leaf_layers(layer) if isinstance(layer, tf.keras.Model) else [layer]
    return out


def is_linear_dense(layer) -> bool:
    """A plain ``Dense`` layer without activation (an affine map)."""
    return type(layer) is tf.keras.layers.Dense and layer.activation is tf.keras.activations.linear


def trainable_dense(model) -> Optional[tf.keras.layers.Layer]:
    """The model's trainable layer when it is the only layer owning trainable weights and a
    ``Dense`` without activation, else ``None``."""
    owners = [layer for layer in _leaf_layers(model) if layer.trainable_weights]
    if len(owners) == 1 and is_linear_dense(owners[0]):
        return owners[0]
    return None


def feeding_clip_norm(model) -> Optional[float]:
    """The radius of the :class:`FeatureClip` whose output is the whole input of the model's trainable
    ``Dense`` layer (read from the model's data flow), else ``None``: the feature bound is then
    *enforced*."""
    target = trainable_dense(model)
    feeder = None if target is None else _feeding(model, target, None)[1]
    return feeder.max_norm if isinstance(feeder, FeatureClip) else None


def _output_feeder(layer):
    """What ``layer``'s output is, as far as :func:`_feeding` cares: a :class:`FeatureClip` (itself,
    or the last layer of a Sequential model), or ``None``."""
    if type(layer) is FeatureClip:
        return layer
    if isinstance(layer, tf.keras.Sequential) and layer.layers:
        return _output_feeder(layer.layers[-1])
    return None


def _feeding(model, target, fed_by) -> Tuple[bool, object]:
    """``(found, feeder)``: whether ``target`` is inside ``model``, and what its whole input is
    when ``model``'s input is ``fed_by``: a :class:`FeatureClip`, :data:`_INPUT` (the outer model's
    input), or ``None`` (something else, or not known for sure), read from the data flow: the
    previous layer of a Sequential model, the one layer feeding a functional model's node."""
    if isinstance(model, tf.keras.Sequential):
        for layer in model.layers:
            if layer is target:
                return True, fed_by
            if isinstance(layer, tf.keras.Model):
                found, feeder = _feeding(layer, target, fed_by)
                if found:
                    return True, feeder
            fed_by = _output_feeder(layer)
        return False, None
    if not getattr(model, "_is_graph_network", False):
        return False, None
    for layer in model.layers:
        inside = layer is target or (isinstance(layer, tf.keras.Model) and target in _leaf_layers(layer))
        if not inside:
            continue
        nodes = [node for i, node in enumerate(layer._inbound_nodes) if f"{layer.name}_ib-{i}" in model._network_nodes]
        sources = tf.nest.flatten(nodes[0].inbound_layers) if len(nodes) == 1 else []
        if len(sources) != 1:
            return True, None  # called several times, or on several tensors
        source = sources[0]
        if isinstance(source, tf.keras.layers.InputLayer):
            feeder = fed_by if len(model.inputs) == 1 else None
        else:
            feeder = _output_feeder(source)
        return (True, feeder) if layer is target else _feeding(layer, target, feeder)
    return False, None


def _input_function(model, target):
    """A function of the model's input that computes ``target``'s input in training mode (the
    layers before it in a Sequential chain, or a sub-model of a functional graph), or ``None``."""
    if isinstance(model, tf.keras.Sequential):
        before = []
        for layer in model.layers:
            if layer is target:
                break
            if isinstance(layer, tf.keras.Model) and target in _leaf_layers(layer):
                inner = _input_function(layer, target)
                if inner is None:
                    return None
                before.append(inner)
                break
            before.append(lambda x, layer=layer: layer(x, training=True))
        else:
            return None

        def chain(x):
            for f in before:
                x = f(x)
            return x

        return chain
    if getattr(model, "_is_graph_network", False) and target in model.layers:
        try:
            sub = tf.keras.Model(model.inputs, target.input)
        except Exception:  # noqa: BLE001 - the layer is called several times, or not on the model's inputs
            return None
        return lambda x: sub(x, training=True)
    return None


def largest_input_norm(model, features) -> Tuple[Optional[float], str]:
    """The largest L2 norm (per example: all dimensions but the first) of an input of the model's
    trainable layer when the model runs on ``features`` as in training, and what was checked; or
    ``(None, why)`` when those inputs cannot be computed (no single trainable ``Dense``, inputs that
    are not one array, layers before it that are not part of one graph with it)."""
    target = trainable_dense(model)
    if target is None:
        return None, "the model has no single trainable Dense layer whose inputs could be computed"
    if features is None or isinstance(features, (dict, list, tuple)):
        return None, "fit does not train on one array of features that could be read"
    x = np.asarray(features)
    if x.ndim < 1 or not np.issubdtype(x.dtype, np.number):
        return None, f"fit trains on features of shape {x.shape} and dtype {x.dtype}, which are not numbers per record"
    prefix = None
    if _feeding(model, target, _INPUT)[1] is not _INPUT:  # layers before it: run them, as fit does
        prefix = _input_function(model, target)
        if prefix is None:
            return None, (
                f"the inputs of the trainable layer {target.name} are computed by layers that could not be "
                "run on their own"
            )
    largest = 0.0
    for start in range(0, len(x), 4096):  # bounded memory
        chunk = x[start : start + 4096]
        # the values the layer computes with: its dtype's rounding of the data (or of the layers before it)
        if prefix is None:
            chunk = chunk.astype(target.compute_dtype)
        else:
            try:
                chunk = np.asarray(prefix(chunk))
            except Exception as err:  # noqa: BLE001 - a prefix Keras cannot run on its own
                return None, f"the layers before the trainable layer {target.name} could not be run on the data ({err})"
        norm = largest_row_norm(chunk)
        if not math.isfinite(norm):
            return norm, f"the {len(x)} records fit trains on"
        largest = max(largest, norm)
    where = f"the {len(x)} records fit trains on" + ("" if prefix is None else " (after the layers before it)")
    return largest, where
