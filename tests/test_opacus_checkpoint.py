"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` with the hidden-state accountant (issue 18):
the whole file is checked before any of it is applied, the ledger is bound to the weights it
describes, and a save is atomic."""

import io
import os
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import ParameterError  # noqa: E402

N, B, D, K, DELTA = 100, 10, 5, 3, 1e-5


def build(seed=0):
    """A shuffle-partition logistic regression with a geometry, its sampler's seed fixed (``seed``
    also sets the initial weights)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(N, D, generator=g), torch.randint(0, K, (N,), generator=g))
    sampler = hso.ShufflePartitionBatchSampler(N, B, seed=5)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(D, K))
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.0),
        data_loader=DataLoader(ds, batch_sampler=sampler), noise_multiplier=1.0, max_grad_norm=1.0,
        poisson_sampling=False)
    hook = hso.ProjectionHook(opt, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=sampler, model=model,
                                optimizer=opt)
    return engine, model, opt, loader


def train(model, opt, loader, epochs):
    for _ in range(epochs):
        for xb, yb in loader:
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()


def snapshot(engine, model, opt):
    """Everything a load may change: weights, optimizer state, ledger, sampler position."""
    return ({k: t.clone() for k, t in model.state_dict().items()}, repr(opt.state_dict()),
            engine.accountant.state_dict(), engine.accountant.sampler.position)


def unchanged(before, engine, model, opt):
    weights, optimizer, ledger, position = before
    now = model.state_dict()
    return (all(torch.equal(weights[k], now[k]) for k in weights) and repr(opt.state_dict()) == optimizer
            and engine.accountant.state_dict() == ledger and engine.accountant.sampler.position == position)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints after epochs 2 and 3 of one run (momentum 0.9 would refuse the geometry: the
    optimizer state is SGD's, with no buffers)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    engine, model, opt, loader = build()
    train(model, opt, loader, 2)
    engine.save_checkpoint(path=tmp / "epoch2.pt", module=model, optimizer=opt)
    eps2 = engine.get_epsilon(DELTA)
    train(model, opt, loader, 1)
    engine.save_checkpoint(path=tmp / "epoch3.pt", module=model, optimizer=opt)
    return tmp, eps2, engine.get_epsilon(DELTA)


def load(path):
    return torch.load(path, weights_only=False)


def test_an_accountant_state_spliced_next_to_later_weights_is_refused(checkpoints, tmp_path):
    """Issue 18: the epoch-2 ledger next to the epoch-3 weights loaded and reported 20 steps for a
    model trained 30; both parts carry valid digests, only the weights binding tells them apart."""
    tmp, eps2, eps3 = checkpoints
    assert eps2 < eps3
    spliced = load(tmp / "epoch3.pt")
    spliced["privacy_accountant_state_dict"] = load(tmp / "epoch2.pt")["privacy_accountant_state_dict"]
    torch.save(spliced, tmp_path / "spliced.pt")
    engine, model, opt, _ = build(seed=1)
    before = snapshot(engine, model, opt)
    with pytest.raises(ParameterError, match=r"^checkpoint: the hidden-state accountant state was saved with other "
                                             r"model weights than the module_state_dict next to it in the file \(spliced"):
        engine.load_checkpoint(path=tmp_path / "spliced.pt", module=model, optimizer=opt)
    assert unchanged(before, engine, model, opt)
    engine.load_checkpoint(path=tmp / "epoch3.pt", module=model, optimizer=opt)  # the real one loads
    assert len(engine.accountant) == 30 and engine.get_epsilon(DELTA) == eps3


def test_a_checkpoint_without_the_accountant_state_changes_nothing(checkpoints, tmp_path):
    """Issue 18: Opacus loaded the weights, then raised KeyError."""
    tmp, *_ = checkpoints
    partial = load(tmp / "epoch3.pt")
    del partial["privacy_accountant_state_dict"]
    torch.save(partial, tmp_path / "partial.pt")
    engine, model, opt, _ = build(seed=1)
    before = snapshot(engine, model, opt)
    with pytest.raises(ParameterError, match="^checkpoint: the file has no privacy_accountant_state_dict .*; nothing was "
                                             "loaded$"):
        engine.load_checkpoint(path=tmp_path / "partial.pt", module=model, optimizer=opt)
    assert unchanged(before, engine, model, opt)


def test_a_broken_optimizer_state_changes_nothing(checkpoints, tmp_path):
    """Issue 18: Opacus applied the weights and the ledger, then the optimizer state failed."""
    tmp, *_ = checkpoints
    broken = load(tmp / "epoch3.pt")
    two_layers = torch.optim.SGD(nn.Sequential(nn.Linear(D, 4), nn.Linear(4, K)).parameters(), lr=0.5)
    broken["optimizer_state_dict"] = two_layers.state_dict()  # 4 parameters for the model's 2
    torch.save(broken, tmp_path / "broken.pt")
    engine, model, opt, _ = build(seed=1)
    before = snapshot(engine, model, opt)
    with pytest.raises(ParameterError, match="^checkpoint: the file has an optimizer_state_dict that does not load into the "
                                             "optimizer .*; nothing was loaded$"):
        engine.load_checkpoint(path=tmp_path / "broken.pt", module=model, optimizer=opt)
    assert unchanged(before, engine, model, opt)


def test_module_weights_of_another_shape_change_nothing(checkpoints, tmp_path):
    """``module.load_state_dict`` copies every tensor that fits before it raises for the one that
    does not: the keys and shapes are checked first."""
    tmp, *_ = checkpoints
    wrong = load(tmp / "epoch3.pt")
    key = next(k for k in wrong["module_state_dict"] if k.endswith("bias"))
    wrong["module_state_dict"][key] = torch.zeros(K + 1)
    torch.save(wrong, tmp_path / "wrong.pt")
    engine, model, opt, _ = build(seed=1)
    before = snapshot(engine, model, opt)
    with pytest.raises(ParameterError, match=f"^checkpoint: the file has {key} of shape \\({K + 1},\\) in its "
                                             "module_state_dict; the module's is"):
        engine.load_checkpoint(path=tmp_path / "wrong.pt", module=model, optimizer=opt)
    assert unchanged(before, engine, model, opt)


def test_an_unbound_or_history_only_accountant_state_is_refused_by_load_checkpoint(checkpoints, tmp_path):
    tmp, *_ = checkpoints
    engine, model, opt, _ = build(seed=1)
    for name, state in (("unbound", None), ("history", {"mechanism": "hidden_state", "history": [(1.0, 0.1, 30)]})):
        ckpt = load(tmp / "epoch3.pt")
        trained, trained_model, trained_opt, _ = build()
        trained.accountant.load_state_dict(ckpt["privacy_accountant_state_dict"])
        ckpt["privacy_accountant_state_dict"] = state or trained.accountant.state_dict()  # written without weights
        torch.save(ckpt, tmp_path / f"{name}.pt")
        before = snapshot(engine, model, opt)
        with pytest.raises(ParameterError, match="^(checkpoint: the hidden-state accountant state is not bound|"
                                                 "sampler: the checkpoint holds only Opacus' history)"):
            engine.load_checkpoint(path=tmp_path / f"{name}.pt", module=model, optimizer=opt)
        assert unchanged(before, engine, model, opt)


def test_a_failure_while_applying_puts_the_module_and_optimizer_back(checkpoints, monkeypatch):
    tmp, *_ = checkpoints
    engine, model, opt, _ = build(seed=1)
    before = snapshot(engine, model, opt)
    real = type(opt).load_state_dict
    calls = []

    def fails_once(self, state):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(self, state)

    monkeypatch.setattr(type(opt), "load_state_dict", fails_once)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.load_checkpoint(path=tmp / "epoch3.pt", module=model, optimizer=opt)
    assert unchanged(before, engine, model, opt)


def _killed_mid_write(real_save):
    """``torch.save`` that writes the first half of the file, then dies."""
    def save(obj, f, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, **kwargs)
        data = buffer.getvalue()
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as out:
                out.write(data[: len(data) // 2])
        else:
            f.write(data[: len(data) // 2])
        raise KeyboardInterrupt("killed during the write")
    return save


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(checkpoints, tmp_path, monkeypatch):
    tmp, _, eps3 = checkpoints
    path = tmp_path / "run.pt"
    path.write_bytes((tmp / "epoch3.pt").read_bytes())
    engine, model, opt, loader = build()
    train(model, opt, loader, 1)
    monkeypatch.setattr(torch, "save", _killed_mid_write(torch.save))
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(path=path, module=model, optimizer=opt)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["run.pt"], "no partial or temporary file is left"
    again, model2, opt2, _ = build(seed=1)
    again.load_checkpoint(path=path, module=model2, optimizer=opt2)  # the previous checkpoint, whole
    assert len(again.accountant) == 30 and again.get_epsilon(DELTA) == eps3


def test_save_to_a_stream_and_a_string_path_and_reload(tmp_path):
    engine, model, opt, loader = build()
    train(model, opt, loader, 1)
    buffer = io.BytesIO()
    engine.save_checkpoint(path=buffer, module=model, optimizer=opt, checkpoint_dict={"foo": "bar"})
    engine.save_checkpoint(path=str(tmp_path / "s.pt"), module=model, optimizer=opt)
    for source in (io.BytesIO(buffer.getvalue()), str(tmp_path / "s.pt"), pathlib.Path(tmp_path / "s.pt")):
        other, model2, opt2, _ = build(seed=1)
        extra = other.load_checkpoint(path=source, module=model2, optimizer=opt2)
        assert other.accountant.state_dict() == engine.accountant.state_dict()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
        assert "optimizer_state_dict" not in extra  # popped, as Opacus does
    assert extra.get("foo") is None and torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)["foo"] == "bar"


def test_engines_with_other_accountants_keep_opacus_methods(tmp_path):
    hso.checkpoint.install()  # idempotent
    assert PrivacyEngine.load_checkpoint.__opacus_original__.__module__ == "opacus.privacy_engine"
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(N, D), torch.randint(0, K, (N,)))
    model = nn.Linear(D, K)
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(ds, batch_size=B), noise_multiplier=1.0,
                                             max_grad_norm=1.0)
    train(model, opt, loader, 1)
    engine.save_checkpoint(path=tmp_path / "rdp.pt", module=model, optimizer=opt)
    assert "hidden_state" not in torch.load(tmp_path / "rdp.pt", weights_only=False)["privacy_accountant_state_dict"]
    other = PrivacyEngine(accountant="rdp")
    other.load_checkpoint(path=tmp_path / "rdp.pt", module=model)
    assert other.accountant.history == engine.accountant.history
