"""Composition baselines against dp_accounting and Opacus, and the C_p operator's validity."""

import math

import numpy as np
import pytest
import dp_accounting as dpa
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from hidden_state_accountants import HiddenStateAccountant, TrainingRunDpEvent
from hidden_state_accountants import fdp
from hidden_state_accountants.analyses import bok, composition
from hidden_state_accountants.analyses._common import Context

ORDERS = tuple(rdp_lib.DEFAULT_RDP_ORDERS)


def run(sampling, n=1000, b=50, steps=200, z=1.5):
    b = n if sampling == "full" else b
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling=sampling,
    )


def test_full_batch_composition_matches_dp_accounting_rdp():
    r = run("full", steps=300)
    # replace-one sensitivity 2C with noise zC: a Gaussian with noise multiplier z/2
    acc = rdp_lib.RdpAccountant(ORDERS).compose(dpa.GaussianDpEvent(r.noise_multiplier / 2), r.steps)
    bound = bok.thm_4_1(r, Context())
    assert np.allclose(bound.rdp(ORDERS), acc._rdp, rtol=1e-12)
    # the exact GDP conversion is at least as good as dp_accounting's RDP conversion
    assert bound.epsilon(1e-5) <= acc.get_epsilon(1e-5)
    assert bound.epsilon(1e-5) == pytest.approx(fdp.gdp_epsilon(2 / 1.5 * math.sqrt(300), 1e-5))


def test_without_replacement_rdp_matches_dp_accounting_public_api():
    r = run("without_replacement")
    acc = rdp_lib.RdpAccountant(ORDERS, dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(
        dpa.SampledWithoutReplacementDpEvent(r.dataset_size, r.batch_size, dpa.GaussianDpEvent(r.noise_multiplier / 2)),
        r.steps,
    )
    ours = composition.without_replacement_rdp(r, Context(orders=ORDERS))
    assert ours.epsilon(1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_cp_profile_single_step_equals_remove_direction_for_positive_eps():
    # For eps >= 0 the symmetrised C_p(G(mu)) has the profile of the dominating remove pair.
    mu, p = 1.3, 0.05
    ref = pld_lib.from_gaussian_mechanism(1 / mu, sampling_prob=p, value_discretization_interval=1e-4)
    eps = np.array([0.0, 0.01, 0.1, 0.5, 1.0, 2.0])
    ours = fdp.subsampled_gaussian_profile(mu, p)(eps)
    assert np.allclose(ours, ref.get_delta_for_epsilon(eps), rtol=2e-3, atol=1e-12)


def test_cp_composition_is_larger_than_add_remove_composition():
    # docs/design.md, section 3: composing add and remove separately is smaller and not valid here.
    mu, p, t = 1.0, 0.01, 2000
    symmetrised = fdp.pld_from_profile(fdp.subsampled_gaussian_profile(mu, p), 1e-3).self_compose(t)
    add_remove = pld_lib.from_gaussian_mechanism(
        1 / mu, sampling_prob=p, value_discretization_interval=1e-3
    ).self_compose(t)
    assert fdp.pld_epsilon(symmetrised, 1e-5) > add_remove.get_epsilon_for_delta(1e-5) + 0.1


def test_bok_4_8_one_step_matches_single_subsampled_gaussian():
    r = run("without_replacement", steps=1, z=1.0)
    ours = bok.thm_4_8(r, Context()).epsilon(1e-5)
    ref = pld_lib.from_gaussian_mechanism(
        0.5, sampling_prob=r.batch_size / r.dataset_size, value_discretization_interval=1e-4
    ).get_epsilon_for_delta(1e-5)
    assert ours >= ref - 1e-9
    assert ours == pytest.approx(ref, abs=2e-3)


def test_pessimistic_pld_dominates_its_profile():
    for mu, p in [(0.5, 0.2), (2.0, 0.01), (1.0, 1.0)]:
        profile = fdp.subsampled_gaussian_profile(mu, p)
        pld = fdp.pld_from_profile(profile, 1e-3)
        eps = np.linspace(-2, 8, 101)
        assert np.all(np.asarray(pld.get_delta_for_epsilon(eps)) >= profile(eps) - 1e-12)


def test_gaussian_pld_composition_matches_closed_form():
    mus = [0.3, 0.7, 1.1]
    composed = (
        fdp.gaussian_pld(mus[0], 1e-4).compose(fdp.gaussian_pld(mus[1], 1e-4)).compose(fdp.gaussian_pld(mus[2], 1e-4))
    )
    exact = fdp.gdp_epsilon(math.sqrt(sum(m * m for m in mus)), 1e-6)
    eps = fdp.pld_epsilon(composed, 1e-6)
    assert exact <= eps <= exact + 0.01


def test_poisson_replace_one_not_below_add_remove():
    # Replace-one allows replacing a record by one contributing zero: at least the add/remove loss.
    r = run("poisson", steps=500, z=1.0)
    ours = HiddenStateAccountant().compose(r).get_epsilon(1e-5)
    q = r.batch_size / r.dataset_size
    add_remove = (
        dpa.pld.PLDAccountant()
        .compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(r.noise_multiplier)), r.steps)
        .get_epsilon(1e-5)
    )
    assert ours >= add_remove


def test_opacus_accountants_agree_on_full_batch_baseline():
    pytest.importorskip("torch")
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    r = run("full", steps=100, z=2.0)
    acc = RDPAccountant()
    acc.history = [(r.noise_multiplier / 2, 1.0, r.steps)]  # replace-one = add/remove with z/2
    ours = HiddenStateAccountant().compose(r).get_epsilon(1e-5)
    assert ours <= acc.get_epsilon(1e-5) + 1e-9
    assert ours == pytest.approx(fdp.gdp_epsilon(2 / 2.0 * 10, 1e-5))


def test_opacus_poisson_add_remove_is_not_larger_than_our_replace_one():
    pytest.importorskip("torch")
    pytest.importorskip("opacus")
    from opacus.accountants import PRVAccountant, RDPAccountant

    r = run("poisson", steps=400, z=1.2)
    q = r.batch_size / r.dataset_size
    ours = HiddenStateAccountant().compose(r).get_epsilon(1e-5)
    for cls in (RDPAccountant, PRVAccountant):
        acc = cls()
        acc.history = [(r.noise_multiplier, q, r.steps)]
        assert acc.get_epsilon(1e-5) <= ours
