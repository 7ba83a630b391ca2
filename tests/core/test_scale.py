"""Issue 10, scale: memory in n/b, PLD bounds for any number of steps, replace-one Poisson RDP."""

import math
import tracemalloc

import numpy as np
import pytest
from scipy import integrate

from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent
from hidden_state_accountants import fdp
from hidden_state_accountants import rdp as rdp_tools
from hidden_state_accountants.analyses import _common as cm
from hidden_state_accountants.analyses import bok, composition, long_composition, shifted_interpolation, ye_shokri
from hidden_state_accountants.rdp import DEFAULT_ORDERS

ORDERS = np.asarray(DEFAULT_ORDERS)
SOME_ORDERS = np.array([1.1, 1.5, 2.0, 3.0, 5.0, 8.0, 16.0, 64.0, 256.0])


def partition_run(l, b=10, steps=1000, z=2.0, m=0.01, lr=0.05, n=None):
    return TrainingRunDpEvent(
        dataset_size=n if n is not None else l * b,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=lr,
        sampling="shuffle_partition",
        geometry=LossGeometry(strong_convexity=m, smoothness=1.0),
    )


def sampled_run(steps, sampling="poisson", z=1.0, n=60000, b=256):
    return TrainingRunDpEvent(
        dataset_size=n,
        batch_size=b,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.05,
        sampling=sampling,
    )


def eps(run, delta=1e-5):
    return HiddenStateAccountant().compose(run).get_epsilon(delta)


# ----------------------------------------------------------------- Ye & Shokri Thm 4.2
def exact_log_mean(run, l, orders):
    """log((1/l) sum_j exp((a-1) eps_0^j)) term by term, summed exactly (math.fsum of expm1)."""
    out = []
    for a in orders:
        e = ye_shokri.eps0(run, np.array([a]), np.arange(1, l + 1))[0]
        with np.errstate(over="ignore"):
            terms = np.expm1((a - 1) * e)
        out.append(math.log1p(math.fsum(terms) / l) if np.all(np.isfinite(terms)) else math.inf)
    return np.array(out)


@pytest.mark.parametrize(
    "l,m,lr,z",
    [
        (10, 0.01, 0.05, 2.0),  # head only: exact
        (5000, 0.01, 0.05, 2.0),  # head + tail bound
        (100_000, 1e-6, 0.05, 0.5),  # rho within 1e-7 of 1: f(j) ~ 1/j
        (100_000, 0.5, 1.0, 1.0),  # rho = 1/4: the tail vanishes
        pytest.param(1_000_000, 0.2, 0.5, 0.3, marks=pytest.mark.slow),
    ],
)
def test_thm42_tail_bound_is_never_below_the_exact_average_and_close_to_it(l, m, lr, z):
    run = partition_run(l, m=m, lr=lr, z=z)
    orders = ORDERS if l <= ye_shokri.HEAD else SOME_ORDERS
    new = ye_shokri.log_mean_exp_eps0(run, orders, l)
    ref = exact_log_mean(run, l, orders)
    ok = np.isfinite(ref)
    assert np.all(new[ok] >= ref[ok] * (1 - 1e-12))
    assert np.all(new[ok] <= ref[ok] * (1 + 1e-3) + 1e-15)
    if l <= ye_shokri.HEAD:
        np.testing.assert_allclose(new[ok], ref[ok], rtol=1e-12)


def _peak_mb(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_shuffle_partition_memory_does_not_grow_with_n_over_b():
    # the old per-position array took 920 MB (traced) at n/b = 10^6 and 8.9 GB at 10^7
    peak = _peak_mb(lambda: eps(partition_run(10**6)))
    assert peak < 80, peak
    bound = ye_shokri.thm_4_2(partition_run(10**8), cm.Context())
    smaller = ye_shokri.thm_4_2(partition_run(10**6), cm.Context())
    assert np.all(np.isfinite(bound.values)) and bound.epsilon(1e-5) < smaller.epsilon(1e-5)
    # issue 11: the position average groups far-back positions (O(1) memory in n/b too)
    peak = _peak_mb(lambda: shifted_interpolation.position_average(partition_run(10**8), cm.Context()).epsilon(1e-5))
    assert peak < 80, peak


def test_shuffle_partition_at_n_2_pow_63():
    run = partition_run(None, n=2**63, b=10)
    value = eps(run)
    assert math.isfinite(value) and value >= 0


def test_thm42_huge_noise_gives_no_negative_divergence():
    # was: "Renyi divergence cannot be negative. Found -4.44e-15" (log-mean-exp minus log l)
    run = TrainingRunDpEvent(
        dataset_size=10**6,
        batch_size=10**5,
        steps=1000,
        noise_multiplier=1e9,
        clip_norm=1.0,
        learning_rate=1.0,
        sampling="shuffle_partition",
        geometry=LossGeometry(strong_convexity=0.5, smoothness=1.0),
    )
    bound = ye_shokri.thm_4_2(run, cm.Context())
    assert np.all(bound.values >= 0)
    assert 0 <= eps(run) < 1e-3


def test_cyclic_composition_with_a_noise_schedule_has_no_per_position_array():
    l = 10**7
    run = TrainingRunDpEvent(
        dataset_size=l * 10,
        batch_size=10,
        steps=50,
        noise_multiplier=[1.0 + i / 50 for i in range(50)],
        clip_norm=1.0,
        learning_rate=0.05,
        sampling="cyclic",
    )
    peak = _peak_mb(lambda: bok.thm_4_4(run, cm.Context()))
    assert peak < 5, peak  # was an array of l * epochs floats (80 MB here)
    assert bok.thm_4_4(run, cm.Context()).mu == pytest.approx(2.0)  # the noisiest step, used once
    long = run.replace(dataset_size=40, batch_size=10)  # l = 4: positions reused
    per = (2.0 / np.array(run.noise_multiplier)) ** 2
    expected = math.sqrt(max(per[i::4].sum() for i in range(4)))
    assert bok.thm_4_4(long, cm.Context()).mu == pytest.approx(expected)


# ----------------------------------------------------------------- long PLD compositions
def test_coarsening_only_raises_delta():
    pld = fdp.pld_from_profile(fdp.subsampled_gaussian_profile(1.0, 0.05), 1e-3).self_compose(50)
    eps_grid = np.linspace(-1.0, 4.0, 301)
    before = np.asarray(pld.get_delta_for_epsilon(eps_grid))
    for factor, d in [(1, 1e-3), (7, 7e-3 * (1 + 1e-12)), (50, 0.05)]:
        after = np.asarray(long_composition.coarsen(pld, factor, d).get_delta_for_epsilon(eps_grid))
        assert np.all(after >= before - 1e-15)
    assert long_composition.coarsen(pld, 50, 0.05).get_epsilon_for_delta(1e-5) < pld.get_epsilon_for_delta(1e-5) + 0.2


@pytest.mark.parametrize("steps", [10**6, 3 * 10**8])
def test_block_composition_is_a_valid_and_tight_bound_on_an_exact_gaussian_composition(steps):
    # G(mu1) composed T times is exactly G(mu1 sqrt(T)); the blocks (forced by a coarse final
    # grid) must stay above the exact epsilon and close to it
    mu1 = 0.01
    single = lambda d: fdp.gaussian_pld(mu1, d)
    clt = lambda k: mu1 * math.sqrt(k)
    base = 1e-3
    d_out = max(0.01, long_composition.grid_for(clt(steps), base))
    pld = long_composition.compose_steps(single, steps, clt, d_out, base)
    exact = fdp.gdp_epsilon(mu1 * math.sqrt(steps), 1e-5)
    value = pld.get_epsilon_for_delta(1e-5)
    assert exact <= value <= exact * 1.01 + 0.05


@pytest.mark.slow
def test_self_composition_of_many_steps_stays_small():
    # dp_accounting's one-FFT size bound grows linearly in the steps (2.4 GB at 10^12 steps)
    pld = fdp.gaussian_pld(1e-6, 1e-3)
    peak = _peak_mb(lambda: long_composition.self_compose(pld, 10**12))
    assert peak < 300, peak
    value = long_composition.self_compose(pld, 10**12).get_epsilon_for_delta(1e-5)
    assert value >= fdp.gdp_epsilon(1.0, 1e-5)


@pytest.mark.parametrize("sampling", ["poisson", pytest.param("without_replacement", marks=pytest.mark.slow)])
def test_composition_bound_is_continuous_across_the_old_size_limit(sampling):
    # before: no PLD above 10^7 steps, and the RDP fallback jumped (Poisson: 853.6 -> 565,358)
    name = "composition_poisson_pld" if sampling == "poisson" else "bok_thm4.8"
    values = []
    for steps in (10**7, 10**7 + 1, 2 * 10**7):
        report = HiddenStateAccountant().compose(sampled_run(steps, sampling)).explain(1e-5)
        pld = next(a for a in report.analyses if a.name == name)
        assert pld.epsilon is not None, pld.reason
        values.append(report.epsilon)
    assert values[0] <= values[1] <= values[2]
    assert values[1] <= values[0] * 1.001
    assert values[2] <= 2.5 * values[0]  # linear at most in this (mu^2/2) regime


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["poisson", "without_replacement"])
def test_composition_bound_grows_smoothly_up_to_a_billion_steps(sampling):
    steps = [10**6, 10**7, 10**8, 10**9]
    values = [eps(sampled_run(t, sampling)) for t in steps]
    assert all(a <= b for a, b in zip(values, values[1:]))
    for a, b in zip(values, values[1:]):
        assert b <= 12 * a  # extrapolation: epsilon ~ T here


# ----------------------------------------------------------------- replace-one Poisson RDP
def renyi_pair(a, q, z, shift_p, shift_q):
    """D_a of (1-q)N(0,z^2) + qN(shift_p, z^2) from (1-q)N(0,z^2) + qN(shift_q, z^2), by quadrature."""

    def log_mix(x, s):
        if s is None:
            return -x * x / (2 * z * z)
        return np.logaddexp(math.log1p(-q) - x * x / (2 * z * z), math.log(q) - (x - s) ** 2 / (2 * z * z))

    f = lambda x: np.exp(a * log_mix(x, shift_p) + (1 - a) * log_mix(x, shift_q) - 0.5 * math.log(2 * math.pi * z * z))
    value, _ = integrate.quad(f, -60 * z - 60, 60 * z + 60, limit=800, points=[-1.0, 0.0, 1.0])
    return math.log(value) / (a - 1)


@pytest.mark.parametrize("q,z", [(0.01, 1.0), (0.0043, 1.0), (0.1, 2.0), (0.01, 0.5), (0.5, 1.0)])
def test_poisson_replace_one_rdp_is_above_the_exact_antipodal_pair(q, z):
    orders = [1.5, 2.0, 4.0, 8.0, 16.0]
    bound = composition.poisson_replace_one_rdp(q, z, orders)
    for a, value in zip(orders, bound):
        exact = renyi_pair(a, q, z, 1.0, -1.0)
        if math.isfinite(exact):
            assert value >= exact * (1 - 1e-6)
    joint = np.logaddexp(math.log1p(-q), math.log(q) + (np.array(orders) - 1) * np.array(orders) * 2 / z**2)
    assert np.all(bound <= joint / (np.array(orders) - 1) + 1e-12)


@pytest.mark.parametrize("q,z", [(0.001, 1.0), (0.01, 0.5), (0.1, 2.0), (0.9, 1.0)])
def test_add_remove_rdp_bounds_both_directions(q, z):
    # the triangle bound needs D_a(N(0) || mixture) <= dp_accounting's D_a(mixture || N(0))
    orders = [1.1, 1.5, 2.5, 4.0, 12.3]
    values = rdp_tools.sampled_gaussian_rdp(q, z, orders)
    for a, value in zip(orders, values):
        assert renyi_pair(a, q, z, None, 1.0) <= value * (1 + 1e-6) + 1e-12


def test_poisson_rdp_is_far_tighter_than_joint_convexity_and_consistent_with_the_pld():
    report = HiddenStateAccountant().compose(sampled_run(10**5)).explain(1e-5)
    by_name = {a.name: a.epsilon for a in report.analyses}
    # joint convexity alone gave 1161 here; the PLD gives about 22
    assert by_name["composition_poisson_rdp"] < 1.5 * by_name["composition_poisson_pld"]
    assert by_name["composition_poisson_pld"] < 1.5 * by_name["composition_poisson_rdp"]


def test_poisson_at_sampling_rate_one():
    # was: ValueError math domain error (log1p(-1))
    run = TrainingRunDpEvent(
        dataset_size=600,
        batch_size=600,
        steps=10,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.1,
        sampling="poisson",
    )
    values = composition.poisson_replace_one_rdp(1.0, 2.0, ORDERS)
    np.testing.assert_allclose(values, ORDERS * 2 / 4.0)
    # ten Gaussian steps with sensitivity 2C: G(sqrt(10)), up to the PLD grid
    assert math.isfinite(eps(run)) and eps(run) <= fdp.gdp_epsilon(math.sqrt(10), 1e-5) * (1 + 1e-4)


def _antipodal_poisson_epsilon(q, z, steps, delta):
    """Epsilon of ``steps`` compositions of (1-q)N(0,1)+qN(1/z,1) vs (1-q)N(0,1)+qN(-1/z,1), the
    replaced record at +C vs -C: privacy losses on a fine x grid, rounded *down* (a lower
    estimate of the truth), convolved by FFT."""
    x = np.linspace(-40, 40, 800_001)
    log_phi = lambda u: -0.5 * u * u - 0.5 * math.log(2 * math.pi)
    lp = np.logaddexp(math.log1p(-q) + log_phi(x), math.log(q) + log_phi(x - 1 / z))
    lq = np.logaddexp(math.log1p(-q) + log_phi(x), math.log(q) + log_phi(x + 1 / z))
    d = 1e-3
    idx = np.floor((lp - lq) / d).astype(np.int64)
    pmf = np.bincount(idx - idx.min(), weights=np.exp(lp) * (x[1] - x[0]))
    n = len(pmf) * steps
    out = np.maximum(np.fft.irfft(np.fft.rfft(pmf, n) ** steps, n), 0)
    losses = (np.arange(n) + idx.min() * steps) * d
    lo, hi = 0.0, 200.0
    for _ in range(50):
        mid = (lo + hi) / 2
        above = losses > mid
        if np.sum(out[above] * -np.expm1(mid - losses[above])) > delta:
            lo = mid
        else:
            hi = mid
    return lo


@pytest.mark.parametrize("z,steps", [(2.0, 10), pytest.param(1.0, 100, marks=pytest.mark.slow)])
def test_poisson_bounds_are_above_the_exact_antipodal_composition(z, steps):
    run = TrainingRunDpEvent(
        dataset_size=60,
        batch_size=6,
        steps=steps,
        noise_multiplier=z,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling="poisson",
    )
    truth = _antipodal_poisson_epsilon(0.1, z, steps, 1e-5)
    report = HiddenStateAccountant().compose(run).explain(1e-5)
    for a in report.analyses:
        if a.epsilon is not None:
            assert a.epsilon >= truth, (a.name, a.epsilon, truth)
    assert report.epsilon <= 2.0 * truth  # and not far above it
