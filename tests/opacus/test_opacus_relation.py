"""Issue 12 in the Opacus adapter: Opacus' convention ADD_OR_REMOVE_ONE by default (its composition
number equals Opacus' own RDP/PRV accountants on the same run), REPLACE_ONE with a note for this
package's fixed-size samplers, and the Poisson hidden-state analyses for Opacus' default loader
once a geometry is configured."""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

from opacus import PrivacyEngine  # noqa: E402
from opacus.accountants import PRVAccountant, RDPAccountant  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, ParameterError  # noqa: E402
from hidden_state_accountants.recording import CompositionFallbackWarning  # noqa: E402

DELTA = 1e-5


def quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CompositionFallbackWarning)
        return fn()


@pytest.mark.parametrize("z, q, steps", [(1.0, 256 / 60000, 2340), (1.5, 0.04, 2250), (0.8, 0.01, 500)])
def test_default_equals_opacus_rdp_and_prv_on_the_same_run(z, q, steps):
    ours = hso.OpacusHiddenStateAccountant()
    ours.history = [(z, q, steps)]
    report = quiet(lambda: ours.explain(DELTA))
    rdp, prv = RDPAccountant(), PRVAccountant()
    rdp.history = prv.history = [(z, q, steps)]
    assert report.neighboring_relation == "ADD_OR_REMOVE_ONE"
    rows = {a.name: a.epsilon for a in report.analyses}
    assert rows["composition_poisson_pld"] == pytest.approx(prv.get_epsilon(DELTA), abs=0.02)  # PRV's eps_error
    # Opacus' RDP conversion (Balle et al. 2020) and its order grid differ from dp_accounting's: within 2%
    assert rows["composition_poisson_rdp"] == pytest.approx(rdp.get_epsilon(DELTA), rel=0.02)
    assert report.epsilon <= min(rdp.get_epsilon(DELTA), prv.get_epsilon(DELTA)) + 0.02
    replace = hso.OpacusHiddenStateAccountant(neighboring_relation="REPLACE_ONE")
    replace.history = [(z, q, steps)]
    r1 = quiet(lambda: replace.explain(DELTA))
    # the replace-one composition is the exact antipodal pair's (docs/derivations.md section 13): larger, not 2x
    assert r1.neighboring_relation == "REPLACE_ONE" and r1.epsilon > 1.1 * report.epsilon


def test_fixed_size_samplers_report_replace_one_with_a_note():
    acc = hso.OpacusHiddenStateAccountant().configure(sampler=hso.CyclicBatchSampler(100, 10))
    acc.history = [(2.0, 0.1, 30)]
    report = quiet(lambda: acc.explain(DELTA))
    assert report.neighboring_relation == "REPLACE_ONE" and math.isfinite(report.epsilon)
    assert any("not the host's ADD_OR_REMOVE_ONE" in n and "cyclic" in n for n in report.notes)
    explicit = hso.OpacusHiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").configure(
        sampler=hso.CyclicBatchSampler(100, 10)
    )
    explicit.history = [(2.0, 0.1, 30)]
    assert quiet(lambda: explicit.get_epsilon(DELTA)) == math.inf  # asked for: not covered, with the reasons
    with pytest.raises(ParameterError, match="neighboring_relation"):
        hso.OpacusHiddenStateAccountant(neighboring_relation="replace")


def test_poisson_loader_with_a_configured_geometry_gets_a_hidden_state_bound():
    """Opacus' default loader, ProjectionHook's L2 term, configure(geometry, model, optimizer, dataset_size)."""
    n, d, k = 400, 5, 3
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g))
    torch.manual_seed(0)
    model = nn.Sequential(hso.FeatureClip(1.0), nn.Linear(d, k))
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(ds, batch_size=40),
        noise_multiplier=2.0,
        max_grad_norm=2.01,  # three classes: a clip that cannot bind (>= sqrt(2 (R^2 + 1)) + 1e-6)
    )
    hook = hso.ProjectionHook(opt, l2_regularization=0.2)
    geometry = hook.logistic_regression_geometry(feature_norm_bound=1.0, num_classes=k)
    with pytest.raises(ParameterError, match="dataset_size"):
        engine.accountant.configure(geometry=geometry, model=model, optimizer=opt)
    engine.accountant.configure(geometry=geometry, model=model, optimizer=opt, dataset_size=n)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompositionFallbackWarning)  # no fallback
        for _ in range(20):
            for xb, yb in loader:
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                opt.zero_grad()
        report = engine.accountant.explain(DELTA)
    run = engine.accountant.training_run()
    assert (run.sampling, run.dataset_size, run.batch_size, run.l2_regularization) == ("poisson", n, 40, 0.2)
    assert run.geometry == geometry and run.sampling_rate == 1 / len(loader)
    rows = {a.name: a for a in report.analyses}
    assert report.neighboring_relation == "ADD_OR_REMOVE_ONE"
    assert rows["si_poisson"].epsilon is not None and report.epsilon < report.composition_epsilon
    assert report.epsilon == HiddenStateAccountant(neighboring_relation="ADD_OR_REMOVE_ONE").compose(run).get_epsilon(
        DELTA
    )
