"""Two CPU processes (gloo): each rank trains on its share of the same global batch, and
both report the core's epsilon for the global run."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")
pytestmark = pytest.mark.torch

import hidden_state_accountants.opacus as hso  # noqa: E402
from hidden_state_accountants import HiddenStateAccountant, LossGeometry, TrainingRunDpEvent  # noqa: E402

WORKER = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    import hidden_state_accountants.opacus as hso

    rank, world, out, sampling = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    N, B = 48, 12
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)
    ds = TensorDataset(x, y, torch.arange(N))
    sampler = (hso.ShufflePartitionBatchSampler(N, B, seed=4) if sampling == "shuffle_partition"
               else hso.WithoutReplacementBatchSampler(N, B, seed=4))
    assert (sampler.num_replicas, sampler.rank) == (world, rank)  # read from torch.distributed
    torch.manual_seed(0)
    model = DPDDP(nn.Sequential(hso.FeatureClip(1.0), nn.Linear(5, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(accountant="hidden_state")
    model, opt, loader = engine.make_private(module=model, optimizer=opt,
        data_loader=DataLoader(ds, batch_sampler=sampler), noise_multiplier=2.0, max_grad_norm=1.0,
        poisson_sampling=False, noise_generator=torch.Generator().manual_seed(rank))
    hook = hso.ProjectionHook(opt, radius=2.0, l2_regularization=0.05)
    engine.accountant.configure(geometry=hook.logistic_regression_geometry(1.0), sampler=sampler, model=model,
                                optimizer=opt)  # model: GradSampleModule(DPDDP(Sequential)), read through
    seen = []
    for epoch in range(2):
        for xb, yb, idx in loader:
            seen.append(idx.tolist())
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
    secret = hso.ShufflePartitionBatchSampler(N, B)  # seed=None: drawn on rank 0, shared
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    json.dump({"batches": seen, "epsilon": engine.get_epsilon(1e-5), "steps": len(engine.accountant),
               "expected_batch_size": opt.expected_batch_size, "params": params,
               "secret_seed": secret.seed}, open(out, "w"))
    dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sampling", ["shuffle_partition", "without_replacement"])
def test_two_gloo_ranks_share_the_global_batch_and_agree_on_epsilon(tmp_path, sampling):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), "2", str(tmp_path / f"r{r}.json"), sampling],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out.decode()[-3000:]
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = (
            hso.ShufflePartitionBatchSampler if sampling == "shuffle_partition" else hso.WithoutReplacementBatchSampler
        )
        single = cls(48, 12, seed=4, num_replicas=1, rank=0)
    steps = 2 * single.steps_per_epoch
    assert res[0]["steps"] == res[1]["steps"] == steps
    for t in range(steps):
        a, b = res[0]["batches"][t], res[1]["batches"][t]
        assert len(a) == len(b) == 6, "each rank gets half of the global batch"
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(single.global_batch(t)), "together: the single-process batch"
    assert res[0]["expected_batch_size"] == 6.0
    assert res[0]["params"] == res[1]["params"], "ranks hold the same model"
    assert res[0]["secret_seed"] == res[1]["secret_seed"], "a secret seed is shared by all ranks"

    run = TrainingRunDpEvent(
        dataset_size=48,
        batch_size=12,
        steps=steps,
        noise_multiplier=2.0,
        clip_norm=1.0,
        learning_rate=0.5,
        sampling=sampling,
        geometry=LossGeometry.logistic_regression(1.0, 0.05, diameter=4.0),
    )
    expected = HiddenStateAccountant().compose(run).get_epsilon(1e-5)
    assert res[0]["epsilon"] == res[1]["epsilon"] == expected
