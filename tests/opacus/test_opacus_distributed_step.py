"""Issue 13, torch.distributed: one step of Opacus' ``DifferentiallyPrivateDistributedDataParallel``
with the package's samplers on 2 gloo ranks, measured against the single-process step and the
accounted update ``theta - lr [(1/b) sum clip_C(g_i) + (z C / b) xi]``:

* signal: every per-example gradient is the same vector ``g`` (``||g|| < C``), no noise: the
  update must be ``-lr g`` exactly, as in one process (signal ratio 1);
* noise: every per-example gradient is zero, ``z > 0``, 20,000 parameters: the update's standard
  deviation must be ``lr z C / b`` (within sampling error), as in one process.

A divisor that does not match the global batch is refused with the replicas' explanation (the
facts carry ``replicas``, ``replica_reduction``, ``replica_share``, ``l2_after_reduction``), and
DP-SBCD, which does not support distribution, refuses it."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

N, B, DIM, LR, Z, C = 48, 12, 20000, 1.0, 1.0, 1.0

WORKER = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    import hidden_state_accountants.opacus as hso
    from hidden_state_accountants import ParameterError

    rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    N, B, DIM, LR, Z, C = {consts}
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)

    def one_step(x, z, dim, seed):
        sampler = hso.CyclicBatchSampler(N, B)  # world size and rank from torch.distributed
        torch.manual_seed(0)
        model = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(model.weight)
        if world > 1:
            model = DPDDP(model)
        engine = PrivacyEngine(accountant="hidden_state")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x), batch_sampler=sampler), noise_multiplier=z,
            max_grad_norm=C, poisson_sampling=False, noise_generator=torch.Generator().manual_seed(seed + rank))
        engine.accountant.configure(sampler=sampler, model=model, optimizer=opt)
        before = model._module.weight.detach().clone() if world == 1 else model._module.module.weight.detach().clone()
        it = iter(loader)
        (xb,) = next(it)
        model(xb).mean().backward()  # the per-example gradient of x_i . w is x_i
        opt.step()
        opt.zero_grad()
        after = model._module.weight if world == 1 else model._module.module.weight
        delta = (after.detach() - before).flatten()
        facts = hso.step_facts(opt, 1 / len(loader), accumulation=1)
        # a divisor that does not match the global batch (per-rank b instead of b / world)
        opt.expected_batch_size = B
        (xb,) = next(it)
        model(xb).mean().backward()
        try:
            opt.step()
            refusal = None
        except ParameterError as err:
            refusal = str(err)
        return delta, facts, refusal, len(xb), len(engine.accountant)

    g = torch.zeros(4)
    g[0], g[1] = 0.3, 0.4  # ||g|| = 0.5 < C: no clipping
    signal, facts, refusal, local, run = one_step(g.repeat(N, 1), 0.0, 4, 0)
    noise, *_ = one_step(torch.zeros(N, DIM), Z, DIM, 1)
    sbcd = None
    if world > 1:
        from hidden_state_accountants.pytorch import DPSBCD
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        try:
            DPSBCD(net, torch.randn(N, 4), torch.randint(0, 3, (N,)), batch_size=B, step_size=0.1, noise=1.0)
        except ParameterError as err:
            sbcd = str(err)
    json.dump({{"signal": signal.tolist(), "noise_std": float(noise.std()), "noise_mean": float(noise.mean()),
               "noise_head": noise[:8].tolist(), "local_batch": local, "refusal": refusal, "sbcd": sbcd,
               "facts": facts.to_dict(), "steps": run}}, open(out, "w"))
    if world > 1:
        dist.destroy_process_group()
""").format(consts=(N, B, DIM, LR, Z, C))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Runs the single process and the 2 gloo ranks side by side (bounded: 180 s)."""
    tmp = tmp_path_factory.mktemp("dpddp")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    jobs = {"single": (0, 1), "rank0": (0, 2), "rank1": (1, 2)}
    procs = {
        k: subprocess.Popen(
            [sys.executable, str(script), str(r), str(w), str(tmp / f"{k}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for k, (r, w) in jobs.items()
    }
    try:
        for k, p in procs.items():
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, f"{k} failed:\n{out.decode()[-3000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {k: json.loads((tmp / f"{k}.json").read_text()) for k in jobs}


def test_signal_of_one_distributed_step_is_the_single_process_step(measured):
    expected = [-LR * 0.3, -LR * 0.4, 0.0, 0.0]
    single, r0, r1 = (measured[k]["signal"] for k in ("single", "rank0", "rank1"))
    assert single == pytest.approx(expected, abs=1e-7)
    assert r0 == pytest.approx(single, abs=1e-7) and r1 == r0, "the same update on both ranks"
    ratio = r0[1] / single[1]
    assert ratio == pytest.approx(1.0, abs=1e-6), f"signal ratio {ratio}"
    assert measured["rank0"]["local_batch"] == B // 2 and measured["single"]["local_batch"] == B


def test_noise_of_one_distributed_step_is_the_accounted_noise(measured):
    accounted = LR * Z * C / B
    # std of a 20,000-sample std estimate: accounted / sqrt(2 * 20,000) = 0.5%; 4 sigma
    for k in ("single", "rank0", "rank1"):
        assert measured[k]["noise_std"] == pytest.approx(accounted, rel=0.02), (k, measured[k]["noise_std"])
        assert abs(measured[k]["noise_mean"]) < 4 * accounted / DIM**0.5
    assert measured["rank0"]["noise_head"] == measured["rank1"]["noise_head"], "one noise draw, on both ranks"


def test_distributed_facts_describe_the_replicas_and_a_wrong_divisor_is_refused_with_why(measured):
    facts = measured["rank1"]["facts"]
    assert (
        facts["replicas"],
        facts["replica_reduction"],
        facts["replica_share"],
        facts["l2_after_reduction"],
        facts["divisor"],
    ) == (2, "mean", 2, True, B / 2)
    assert measured["single"]["facts"]["replicas"] == 1
    refusal = measured["rank0"]["refusal"]
    assert refusal is not None and refusal.startswith("batch_size: the update divides the clipped sum by 24")
    assert "2 replicas each divide their part of the batch by 12 and the framework averages" in refusal
    assert "effective learning rate is 0.5 times the one set" in refusal


def test_dp_sbcd_refuses_torch_distributed(measured):
    assert measured["rank0"]["sbcd"].startswith("distributed: DP-SBCD is not supported under torch.distributed")
