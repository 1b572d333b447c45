import os
import time
import uuid

import pytest
import torch

from specpool.engine.runtime.config import tiny_config
from specpool.engine.runtime.device import native_bf16
from specpool.engine.runtime.model import Llama
from specpool.engine.runtime.process_env import NO_NATIVE_BF16
from tests.harness import (  # noqa: F401 - every test's time limit, crashes reported once
    add_time_limits,
    pytest_runtest_makereport,
    pytest_runtest_protocol,
    pytest_xdist_make_scheduler,
)
from tests.pki import CA
from tests.stats import FULL_POWER

# Servers the tests start run secure, as in production: they issue themselves certificates from CA.
os.environ.update(CA.env)

# Every process this test session starts, directly or not, inherits this tag in its environment:
# it finds them again, orphans included, to check that no test leaves one running.
# Under pytest-xdist each worker has its own tag (it inherits the controller's), so that one worker's
# check does not see the other's servers.
TEST_RUN = "SPECPOOL_TEST_RUN"
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if not os.environ.get(TEST_RUN, "").endswith(f"-{_worker}"):  # a second import keeps the tag
    os.environ[TEST_RUN] = f"{uuid.uuid4().hex}-{_worker}"
_started_during: dict[int, str] = {}  # pid -> the test during which it was first seen


def tagged_processes() -> dict[int, str]:
    """pid -> command line of the live processes (not zombies) that carry this session's tag, less
    multiprocessing's own helpers (its resource tracker lives as long as this process, by design)."""
    needle = f"{TEST_RUN}={os.environ[TEST_RUN]}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if "from multiprocessing." not in cmd:
                found[int(entry)] = cmd
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fails the last test of a module whose processes outlive it (module fixtures end there), naming
    the test that started each; the leaked processes are killed so the next module starts clean."""
    result = yield
    for pid in tagged_processes():
        _started_during.setdefault(pid, item.nodeid)
    if nextitem is not None and nextitem.module is item.module:
        return result
    deadline = time.monotonic() + 15  # a server that was just told to stop may still be draining
    while (alive := tagged_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive:
        for pid in alive:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        leaks = "\n".join(f"  pid {pid} (started during {_started_during.get(pid, item.nodeid)}): {cmd}"
                          for pid, cmd in alive.items())
        pytest.fail(f"processes left running after the tests of {item.module.__name__}:\n{leaks}", pytrace=False)
    return result


def pytest_collection_modifyitems(config, items):
    """Outside `make test-full`, the tests marked `full_power` are deselected (tests/stats.py): twins
    placed near the full-power detection limit, which the CI tier's rows would not catch, and variants'
    twins, whose mechanism's twin runs in both tiers. Every test gets its time limit (tests/harness.py)."""
    add_time_limits(items)
    if FULL_POWER:
        return
    deselected = [item for item in items if item.get_closest_marker("full_power")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("full_power")]


# A machine without native bf16 runs the same code under both kinds: there the second one would repeat the first.
CPU_KINDS = ["native", "no-native-bf16"] if native_bf16("cpu") else ["native"]


@pytest.fixture(params=CPU_KINDS)
def cpu_kind(request, monkeypatch) -> str:
    """Runs a test as this machine is and, where it has native bf16, as a machine without it
    (SPECPOOL_NO_NATIVE_BF16: in-process models then load as fp32, and the servers a test starts also
    run AVX2 kernels only, so oneDNN refuses bf16 there exactly as on an AVX2 CPU)."""
    if request.param == "no-native-bf16":
        monkeypatch.setenv(NO_NATIVE_BF16, "1")
    return request.param


@pytest.fixture(scope="session")
def tiny_model() -> Llama:
    return Llama.random_init(tiny_config(vocab_size=64), seed=0)


@pytest.fixture(scope="session")
def real_model():
    """The default target (SmolLM2-135M, fp32) and its tokenizer: loaded once per test session."""
    from specpool.engine.runtime.gguf_loader import default_model_path

    torch.manual_seed(0)
    return Llama.from_gguf(default_model_path(), dtype="fp32", device="cpu")


@pytest.fixture(scope="session")
def default_format_model():
    """The default target in the format a server picks by default (`--dtype auto`: q4 on CPU where the
    engine's kernels or torch's int4 kernel run) and its tokenizer: what a served target's output equals."""
    from specpool.engine.runtime.gguf_loader import default_model_path

    return Llama.from_gguf(default_model_path(), dtype="auto", device="cpu")


@pytest.fixture(scope="session")
def hf_model():
    """The independent oracle: transformers' LlamaForCausalLM reading the same GGUF (tests only)."""
    import transformers  # the declared test dependency (pyproject's "test" extra): missing is an error

    from specpool.engine.runtime.gguf_loader import default_model_path

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
