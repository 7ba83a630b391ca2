"""A Keras model's structure as core :class:`~hidden_state_accountants.recording.ModelFacts`.

Sequential and functional models are read layer by layer in the order the forward pass
applies them (nested models looked into, a layer called twice listed twice); a subclassed
model's ``call`` is custom code, so its structure is marked incomplete. Whether the structure
backs a declared geometry is the core's decision
(:func:`hidden_state_accountants.recording.model_refusal`). A
:class:`~hidden_state_accountants.keras.features.FeatureClip` feeding the one trainable ``Dense``
layer (:func:`~hidden_state_accountants.keras.features.feeding_clip_norm`) enforces the geometry's
feature bound (``ModelFacts.feature_clip_norm``).

:func:`install` (run when :mod:`hidden_state_accountants.tf_privacy` is imported) makes
``Model.load_weights`` and ``load_model`` remember that a model's weights came from storage
(:func:`loaded_weights`), which the callback hands to the core's
:func:`~hidden_state_accountants.recording.check_initial_weights`.
"""

from __future__ import annotations

import functools
import weakref
from typing import List, Optional

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


# ------------------------------------------------------------------ weights from storage
_LOADED: "weakref.WeakKeyDictionary[tf.keras.Model, str]" = weakref.WeakKeyDictionary()


def loaded_weights(model, *, forget: bool = False) -> Optional[str]:
    """How ``model``'s weights were last loaded from storage (e.g. ``"model.load_weights('w.h5')"``), or
    ``None`` when :func:`install`'s wrappers saw no load (since it was forgotten: ``forget=True``, once
    the run accounts for it)."""
    return _LOADED.pop(model, None) if forget else _LOADED.get(model)


def _load_weights(original):
    @functools.wraps(original)
    def load_weights(self, filepath, *args, **kwargs):
        out = original(self, filepath, *args, **kwargs)
        _LOADED[self] = f"model.load_weights({str(filepath)!r})"
        return out

    load_weights.__hsa_original__ = original
    return load_weights


def _load_model(original):
    @functools.wraps(original)
    def load_model(filepath, *args, **kwargs):
        model = original(filepath, *args, **kwargs)
        if isinstance(model, tf.keras.Model):
            _LOADED[model] = f"load_model({str(filepath)!r})"
        return model

    load_model.__hsa_original__ = original
    return load_model


def install() -> None:
    """Makes ``tf.keras.Model.load_weights`` and ``tf.keras.models.load_model`` / ``tf.keras.saving.load_model``
    remember the models whose weights they load (:func:`loaded_weights`); idempotent. A name bound before
    this module was imported (``from tensorflow.keras.models import load_model``), and ``keras``' own
    namespace (``keras.models.load_model``), keep Keras' function."""
    current = tf.keras.Model.load_weights
    if not hasattr(current, "__hsa_original__"):
        tf.keras.Model.load_weights = _load_weights(current)
    for module in (tf.keras.models, tf.keras.saving):
        current = getattr(module, "load_model", None)
        if current is not None and not hasattr(current, "__hsa_original__"):
            module.load_model = _load_model(current)
