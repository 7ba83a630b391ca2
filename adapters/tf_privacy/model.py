"""A Keras model's structure as core :class:`~hidden_state_accountants.recording.ModelFacts`.

Sequential and functional models are read layer by layer in the order the forward pass
applies them (nested models looked into, a layer called twice listed twice); a subclassed
model's ``call`` is custom code, so its structure is marked incomplete. Whether the structure
backs a declared geometry is the core's decision
(:func:`hidden_state_accountants.recording.model_refusal`). A
:class:`~hidden_state_accountants.keras.features.FeatureClip` feeding the one trainable ``Dense``
layer (:func:`~hidden_state_accountants.keras.features.feeding_clip_norm`) enforces the geometry's
feature bound (``ModelFacts.feature_clip_norm``).
"""

from __future__ import annotations

from typing import List

import tensorflow as tf

from hidden_state_accountants.keras.features import feeding_clip_norm, is_linear_dense, trainable_dense
from hidden_state_accountants.recording import LayerFacts, LayerKind, ModelFacts

_RANDOM_LAYERS = (tf.keras.__internal__.layers.BaseRandomLayer, tf.keras.layers.Dropout, tf.keras.layers.GaussianNoise)


def _kind(layer) -> LayerKind:
    if is_linear_dense(layer):
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
    ``other`` for the rest; ``trainable`` for layers that own trainable weights; ``outputs``: the
    ``units`` of the one trainable ``Dense`` (the number of logits).

    >>> import tensorflow as tf
    >>> m = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,))], name="lr")
    >>> [(str(x.kind), x.trainable) for x in model_facts(m).layers], model_facts(m).outputs
    ([('affine', True)], 3)
    """
    layers: List[LayerFacts] = []
    complete = _read(model, layers)
    what = f"the Keras model {model.name!r}" + ("" if complete else f" ({type(model).__name__}, subclassed)")
    clip = feeding_clip_norm(model) if complete else None
    target = trainable_dense(model) if complete else None
    outputs = None if target is None else int(target.units)
    return ModelFacts(layers=layers, complete=complete, description=what, feature_clip_norm=clip, outputs=outputs)
