"""``PrivacyEngine`` for the hidden-state accountant: calibration of the configured claim, checkpoints
that are all or nothing, bound to the weights and atomic.

For an engine whose accountant is the hidden-state one, :func:`install` (run when
:mod:`hidden_state_accountants.opacus` is imported) makes four of its methods call the functions
here, with Opacus' signatures; other engines keep Opacus' methods:

* ``make_private`` tells the accountant the data loader it is given (its dataset size; with
  ``poisson_sampling=False`` and no declared sampler the claim becomes the loader's schedule:
  :meth:`~.accountant.OpacusHiddenStateAccountant.check_data_loader`) and the one it returns
  (:meth:`~.accountant.OpacusHiddenStateAccountant.watch_data_loader`);
* ``make_private_with_epsilon`` hands Opacus' calibration, which builds a fresh accountant by name,
  the *configured* claim (:meth:`~.accountant.OpacusHiddenStateAccountant.calibration_for`);
* ``save_checkpoint`` seals the digest of the module weights it writes into the accountant state and
  writes the file atomically (:func:`~hidden_state_accountants.checkpoint.write_atomically`);
* ``load_checkpoint`` checks every part of the file (the accountant state, that it was saved with
  these weights, the module state's keys and shapes, the optimizer state in a copy of the optimizer)
  before it applies any, and puts the module and optimizer back if applying fails anyway.

docs/opacus.md ("Checkpoints") says what each check refuses, and why Opacus' own methods are not enough.
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import pickle
import warnings
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

import torch
from opacus import PrivacyEngine
from opacus.optimizers import DPOptimizer

from hidden_state_accountants import validation as v
from hidden_state_accountants.checkpoint import refusal, weights_digest, write_atomically

from .accountant import CALIBRATION_KWARG, OpacusHiddenStateAccountant

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "make_private",
    "make_private_with_epsilon",
    "module_weights_digest",
    "install",
]

_FILE, _NOTHING_LOADED = "the file", "; nothing was loaded"
_MODULE, _ACCOUNTANT, _OPTIMIZER = "module_state_dict", "privacy_accountant_state_dict", "optimizer_state_dict"
_SCHEDULERS = (
    ("noise_scheduler", "noise_scheduler_state_dict"),
    ("grad_clip_scheduler", "grad_clip_scheduler_state_dict"),
)


def module_weights_digest(state: Mapping[str, Any]) -> str:
    """:func:`~hidden_state_accountants.checkpoint.weights_digest` of a module state dict: each
    tensor by name, dtype, shape and bytes (on the CPU, so a state saved on a GPU and loaded on
    the CPU has the same digest); other entries (a module's extra state) by their pickle."""

    def arrays() -> Iterator[Tuple[str, str, Tuple[int, ...], Any]]:
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                t = value.detach()
                if t.layout != torch.strided:
                    t = t.to_dense()
                t = t.cpu().contiguous().reshape(-1)
                yield str(name), str(value.dtype), tuple(value.shape), t.view(torch.uint8).numpy()
            else:
                yield str(name), type(value).__name__, (), pickle.dumps(value, protocol=4)

    return weights_digest(arrays())


def save_checkpoint(
    engine: PrivacyEngine,
    *,
    path,
    module,
    optimizer=None,
    noise_scheduler=None,
    grad_clip_scheduler=None,
    checkpoint_dict: Optional[Dict[str, Any]] = None,
    module_state_dict_kwargs: Optional[Dict[str, Any]] = None,
    torch_save_kwargs: Optional[Dict[str, Any]] = None,
) -> None:
    """Opacus' ``PrivacyEngine.save_checkpoint`` with the accountant state bound to the module
    weights it saves, written atomically to a path (see the module docstring)."""
    accountant = _hidden_state_accountant(engine)
    checkpoint = checkpoint_dict or {}  # filled in place, as Opacus does
    checkpoint[_MODULE] = module.state_dict(**(module_state_dict_kwargs or {}))
    checkpoint[_ACCOUNTANT] = accountant.state_dict(weights_digest=module_weights_digest(checkpoint[_MODULE]))
    if optimizer is not None:
        checkpoint[_OPTIMIZER] = optimizer.state_dict()
    for (_, key), scheduler in zip(_SCHEDULERS, (noise_scheduler, grad_clip_scheduler)):
        if scheduler is not None:
            checkpoint[key] = scheduler.state_dict()
    kwargs = torch_save_kwargs or {}
    if isinstance(path, (str, os.PathLike)):
        write_atomically(path, lambda f: torch.save(checkpoint, f, **kwargs))
    else:
        torch.save(checkpoint, path, **kwargs)


def load_checkpoint(
    engine: PrivacyEngine,
    *,
    path,
    module,
    optimizer=None,
    noise_scheduler=None,
    grad_clip_scheduler=None,
    module_load_dict_kwargs: Optional[Dict[str, Any]] = None,
    torch_load_kwargs: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Opacus' ``PrivacyEngine.load_checkpoint``, checking the whole file before applying any of
    it (see the module docstring). Returns the checkpoint without the optimizer's and schedulers'
    states, as Opacus does.

    Raises:
      ParameterError: ``checkpoint`` (or the configuration's parameter) with what does not hold;
        nothing was applied then.
    """
    accountant = _hidden_state_accountant(engine)
    checkpoint = _read(path, torch_load_kwargs or {})
    if not isinstance(checkpoint, dict):
        raise refusal(
            _FILE, f"holds a {type(checkpoint).__name__}, not the dict save_checkpoint writes{_NOTHING_LOADED}"
        )
    for key in (_MODULE, _ACCOUNTANT):
        if key not in checkpoint:
            raise refusal(_FILE, f"has no {key} (not written by PrivacyEngine.save_checkpoint){_NOTHING_LOADED}")
    module_kwargs = module_load_dict_kwargs or {}
    apply_accountant, run = accountant.check_state_dict(checkpoint[_ACCOUNTANT])
    if run is None:
        raise refusal(
            _FILE,
            f"has an accountant state of Opacus' history only, which cannot be shown to describe "
            f"the {_MODULE} next to it (load it alone with engine.accountant.load_state_dict if you "
            f"vouch for it){_NOTHING_LOADED}",
        )
    _check_module_state(module, checkpoint[_MODULE], strict=module_kwargs.get("strict", True))
    run.check_weights(module_weights_digest(checkpoint[_MODULE]), f"the {_MODULE} next to it in the file")
    optimizer_state = checkpoint.pop(_OPTIMIZER, {})
    if not isinstance(optimizer_state, dict):
        raise refusal(
            _FILE, f"has an {_OPTIMIZER} of type {type(optimizer_state).__name__}, not a dict{_NOTHING_LOADED}"
        )
    load_optimizer = optimizer is not None and len(optimizer_state) > 0
    if load_optimizer:
        _check_optimizer_state(optimizer, optimizer_state)
    elif (optimizer is not None) ^ (len(optimizer_state) > 0):
        warnings.warn(
            f"optimizer_state_dict has {len(optimizer_state)} items but optimizer is "
            f"{'' if optimizer else 'not'} provided."
        )  # Opacus' warning
    schedulers = []
    for (_, key), scheduler in zip(_SCHEDULERS, (noise_scheduler, grad_clip_scheduler)):
        state = checkpoint.pop(key, {})
        if not isinstance(state, dict):
            raise refusal(_FILE, f"has a {key} that is not a dict{_NOTHING_LOADED}")
        if scheduler is not None and state:
            schedulers.append((scheduler, state))

    # everything holds: apply, putting the module and optimizer back if that fails anyway
    weights = {k: t.detach().clone() if isinstance(t, torch.Tensor) else t for k, t in module.state_dict().items()}
    optimizer_before = optimizer.state_dict() if load_optimizer else None  # load replaces, never mutates, its state
    try:
        module.load_state_dict(checkpoint[_MODULE], **module_kwargs)
        if load_optimizer:
            optimizer.load_state_dict(optimizer_state)
    except BaseException:
        module.load_state_dict(weights)
        if load_optimizer:
            optimizer.load_state_dict(optimizer_before)
        raise
    for scheduler, state in schedulers:
        scheduler.load_state_dict(state)  # a dict update
    apply_accountant()  # assignments only
    return checkpoint


def _read(path, torch_load_kwargs: Dict[str, Any]) -> Any:
    """``torch.load`` of the file; one that cannot be read back (truncated, not a checkpoint) is refused
    as ``checkpoint: the file ...`` (a path that cannot be opened keeps its ``OSError``)."""
    kwargs = {"weights_only": False, **torch_load_kwargs}  # as Opacus; True works too (plain Python state)
    try:
        return torch.load(path, **kwargs)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - torch.load's RuntimeError, pickle's UnpicklingError, EOFError, ...
        reason = str(err).splitlines()[0] if str(err) else "no message"
        raise refusal(
            _FILE,
            f"cannot be read by torch.load ({type(err).__name__}: {reason}): truncated, or not a checkpoint"
            f"{_NOTHING_LOADED}",
        ) from None


def _hidden_state_accountant(engine) -> OpacusHiddenStateAccountant:
    accountant = getattr(engine, "accountant", None)
    if not isinstance(accountant, OpacusHiddenStateAccountant):
        raise v.ParameterError(
            "engine", f'must be a PrivacyEngine(accountant="hidden_state"), got one with {type(accountant).__name__}'
        )
    return accountant


def _check_module_state(module, state, *, strict: bool) -> None:
    """What ``module.load_state_dict`` checks (keys, shapes), before it copies anything."""
    if not isinstance(state, Mapping):
        raise refusal(_FILE, f"has a {_MODULE} of type {type(state).__name__}, not a mapping{_NOTHING_LOADED}")
    current = module.state_dict()
    missing, unexpected = sorted(set(current) - set(state)), sorted(set(state) - set(current))
    if strict and (missing or unexpected):
        raise refusal(
            _FILE,
            f"has a {_MODULE} of another module: missing {missing[:5]}, unexpected {unexpected[:5]}{_NOTHING_LOADED}",
        )
    for key in sorted(set(current) & set(state)):
        mine, theirs = current[key], state[key]
        if isinstance(mine, torch.Tensor) and (not isinstance(theirs, torch.Tensor) or theirs.shape != mine.shape):
            shape = tuple(theirs.shape) if isinstance(theirs, torch.Tensor) else type(theirs).__name__
            raise refusal(
                _FILE,
                f"has {key} of shape {shape} in its {_MODULE}; the module's is {tuple(mine.shape)}{_NOTHING_LOADED}",
            )


def _check_optimizer_state(optimizer, state) -> None:
    """Loads ``state`` into a copy of the optimizer (sharing the parameters, with its own state and
    parameter groups: the optimizer itself is not touched)."""
    base = optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer
    trial = copy.copy(base)
    trial.state = collections.defaultdict(dict)
    trial.param_groups = [dict(group) for group in base.param_groups]
    try:
        trial.load_state_dict(state)
    except Exception as err:  # noqa: BLE001 - any failure means the state does not load
        raise refusal(
            _FILE,
            f"has an {_OPTIMIZER} that does not load into the optimizer ({type(err).__name__}: {err}){_NOTHING_LOADED}",
        ) from None


def make_private(engine: PrivacyEngine, *args, _original, data_loader, **kwargs):
    """Opacus' ``make_private``, after the accountant has seen the data loader (its dataset size, and
    what its batches make the claim: ``check_data_loader``); the accountant then watches the loader it
    returns (``watch_data_loader``)."""
    accountant = _hidden_state_accountant(engine)
    accountant.check_data_loader(data_loader, poisson_sampling=kwargs.get("poisson_sampling", True))
    out = _original(engine, *args, data_loader=data_loader, **kwargs)
    accountant.watch_data_loader(out[-1])  # (module, optimizer, [criterion,] data_loader)
    return out


def make_private_with_epsilon(engine: PrivacyEngine, *args, _original, data_loader, optimizer, max_grad_norm, **kwargs):
    """Opacus' ``make_private_with_epsilon``, calibrating the accountant's configured claim (see the
    module docstring); explicit ``**engine.accountant.calibration_kwargs(...)`` are checked to be
    this claim's."""
    spec = _hidden_state_accountant(engine).calibration_for(
        data_loader=data_loader,
        optimizer=optimizer,
        max_grad_norm=max_grad_norm,
        spec=kwargs.pop(CALIBRATION_KWARG, None),
        poisson_sampling=kwargs.get("poisson_sampling", True),
    )
    if spec is not None:
        kwargs[CALIBRATION_KWARG] = spec
    return _original(engine, *args, data_loader=data_loader, optimizer=optimizer, max_grad_norm=max_grad_norm, **kwargs)


def install() -> None:
    """Makes ``PrivacyEngine``'s ``make_private``, ``make_private_with_epsilon``, ``save_checkpoint`` and
    ``load_checkpoint`` call the functions here for engines whose accountant is the hidden-state one
    (idempotent)."""
    ours = {
        "make_private": make_private,
        "make_private_with_epsilon": make_private_with_epsilon,
        "save_checkpoint": save_checkpoint,
        "load_checkpoint": load_checkpoint,
    }
    for name, wrapper in ours.items():
        current = getattr(PrivacyEngine, name)
        original = getattr(current, "__opacus_original__", current)
        if name.startswith("make_private"):
            wrapper = functools.partial(wrapper, _original=original)

        @functools.wraps(original)
        def method(self, *args, _original=original, _ours=wrapper, **kwargs):
            if isinstance(getattr(self, "accountant", None), OpacusHiddenStateAccountant):
                return _ours(self, *args, **kwargs)
            return _original(self, *args, **kwargs)

        method.__opacus_original__ = original
        setattr(PrivacyEngine, name, method)
