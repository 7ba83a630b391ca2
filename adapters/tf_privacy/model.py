"""A Keras model's structure as core :class:`~hidden_state_accountants.recording.ModelFacts`,
and the inputs its trainable layer sees.

Sequential and functional models are read layer by layer in the order the forward pass
applies them (nested models looked into, a layer called twice listed twice); a subclassed
model's ``call`` is custom code, so its structure is marked incomplete. Whether the structure
backs a declared geometry is the core's decision
(:func:`hidden_state_accountants.recording.model_refusal`).

:class:`FeatureClip` bounds every input's norm; when it feeds the one trainable ``Dense`` layer
(read from the model's data flow), the geometry's feature bound is enforced
(``ModelFacts.feature_clip_norm``). Otherwise :func:`largest_input_norm` computes the inputs of
that layer on the data ``fit`` trains on, for the core to check before any step.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import numpy as np
import tensorflow as tf

from hidden_state_accountants import validation as v
from hidden_state_accountants.projection import inside_factor
from hidden_state_accountants.recording import LayerFacts, LayerKind, ModelFacts

from .data import largest_row_norm

_RANDOM_LAYERS = (tf.keras.__internal__.layers.BaseRandomLayer, tf.keras.layers.Dropout, tf.keras.layers.GaussianNoise)


def _kind(layer) -> LayerKind:
    if type(layer) is tf.keras.layers.Dense and layer.activation is tf.keras.activations.linear:
        return LayerKind.AFFINE
    return LayerKind.RANDOM if isinstance(layer, _RANDOM_LAYERS) else LayerKind.OTHER


def _calls(model, layer) -> int:
    """How often ``model``'s graph calls ``layer`` (a shared layer is applied several times)."""
    nodes = getattr(model, "_network_nodes", None)
    if not nodes:
        return 1
    return max(1, sum(f"{layer.name}_ib-{i}" in nodes for i in range(len(layer._inbound_nodes))))


def _read(model, out: List[LayerFacts]) -> bool:
    """Appends ``model``'s layers to ``out``; False when some forward pass is custom code."""
    if not isinstance(model, tf.keras.Sequential) and not getattr(model, "_is_graph_network", False):
        return False
    complete = True
    for layer in model.layers:
        if isinstance(layer, tf.keras.layers.InputLayer):
            continue
        for _ in range(_calls(model, layer)):
            if isinstance(layer, tf.keras.Model):
                complete = _read(layer, out) and complete
            else:
                out.append(LayerFacts(name=layer.name, kind=_kind(layer), trainable=bool(layer.trainable_weights)))
    return complete


def model_facts(model: tf.keras.Model) -> ModelFacts:
    """The layers of ``model`` in forward order: ``affine`` for a ``Dense`` without activation,
    ``random`` for layers that draw randomness in training (dropout, noise, augmentation),
    ``other`` for the rest; ``trainable`` for layers that own trainable weights.

    >>> import tensorflow as tf
    >>> m = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))], name="lr")
    >>> [(str(x.kind), x.trainable) for x in model_facts(m).layers]
    [('affine', True)]
    """
    layers: List[LayerFacts] = []
    complete = _read(model, layers)
    what = f"the Keras model {model.name!r}" + ("" if complete else f" ({type(model).__name__}, subclassed)")
    target = trainable_dense(model) if complete else None
    feeder = None if target is None else _feeding(model, target, None)[1]
    clip = feeder.max_norm if isinstance(feeder, FeatureClip) else None
    return ModelFacts(layers=layers, complete=complete, description=what, feature_clip_norm=clip)


# ------------------------------------------------------------------------------ features
_INPUT = "the model's input"  # marks "fed by the model's input, unchanged" in _feeding


_EPS = {tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7, tf.float32: 2.0**-23, tf.float64: 2.0**-52}
"""Machine epsilons (numpy's finfo does not know bfloat16)."""


def dtype_eps(dtype) -> float:
    """The machine epsilon of a TensorFlow dtype (0 for integers; bfloat16's for an unknown float)."""
    return _EPS.get(dtype, 2.0**-7) if dtype.is_floating else 0.0


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


def _leaf_layers(model) -> List[tf.keras.layers.Layer]:
    out = []
    for layer in model.layers:
        out += _leaf_layers(layer) if isinstance(layer, tf.keras.Model) else [layer]
    return out


def trainable_dense(model) -> Optional[tf.keras.layers.Layer]:
    """The model's trainable layer when it is the only layer owning trainable weights and a
    ``Dense`` without activation, else ``None``."""
    owners = [layer for layer in _leaf_layers(model) if layer.trainable_weights]
    if len(owners) == 1 and _kind(owners[0]) is LayerKind.AFFINE:
        return owners[0]
    return None


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
