"""A CPU feature counts once a child process has executed it (engine/runtime/cpu_features.py), and every
choice that follows (the engine's kernel ISA, oneDNN's and ATen's ceilings, native bf16) reads the probes,
not CPUID: an Intel VM advertised AMX and faulted on it (issue 48). A CPU that lies is emulated by handing a
process probe results (SPECPOOL_CPU_FEATURES) as a parent would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from specpool.engine.runtime import cpu_features
from specpool.engine.runtime.process_env import isa_ceilings


def test_an_instruction_the_cpu_refuses_is_a_failed_probe_not_a_crash():
    results = cpu_features._run_probes({"ud2": bytes.fromhex("0f0bc3"),  # ud2: SIGILL in the child
                                        "ret": bytes.fromhex("c3")})
    assert results == {"ud2": False, "ret": True}


def test_probes_are_run_once_and_inherited_by_child_processes():
    executes = cpu_features.executes()
    assert set(executes) == set(cpu_features.PROBES)
    assert cpu_features._parse(os.environ[cpu_features.CACHE_ENV]) == executes
    advertised = cpu_features.advertised_flags()
    for name, ok in executes.items():  # nothing counts that the CPU does not even claim
        assert not ok or all(flag in advertised for flag in cpu_features.PROBES[name][0]), name
    assert cpu_features._parse("avx2=1") is None and cpu_features._parse("garbage") is None


def child_choices(features: dict[str, bool]) -> dict:
    """What a fresh process chooses when its probes say `features`."""
    code = ("import json, os, specpool, torch; from specpool.engine.runtime import device; "
            "print(json.dumps({'isa': device.kernel_isa(), 'bf16': device.native_bf16('cpu'), "
            "'onednn': os.environ.get('ONEDNN_MAX_CPU_ISA'), 'aten': os.environ.get('ATEN_CPU_CAPABILITY'), "
            "'capability': torch.backends.cpu.get_cpu_capability()}))")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY",
                                                            "SPECPOOL_NO_NATIVE_BF16", "SPECPOOL_KERNEL_ISA")}
    env[cpu_features.CACHE_ENV] = ",".join(f"{name}={int(features.get(name, False))}" for name in cpu_features.PROBES)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1]) | {"log": out.stderr}


def test_a_cpu_that_faults_on_what_it_advertises_is_kept_to_what_ran():
    real = cpu_features.executes()
    advertised = cpu_features.advertised_flags()
    if real["amx"]:  # AMX advertised and executed here: as the VM that faulted on it, the rest as they are
        choices = child_choices(real | {"amx": False})
        assert choices["onednn"] == isa_ceilings(lambda name: (real | {"amx": False})[name])[0] != "ALL"
        assert "advertises amx but faults" in choices["log"]
    if real["avx512"]:  # AVX-512 advertised and executed: as a CPU that faults on it
        lying = real | {"avx512": False, "avx512_vnni": False, "avx512_bf16": False, "amx": False}
        choices = child_choices(lying)
        assert (choices["capability"], choices["isa"], choices["bf16"]) == ("AVX2", "avx2", False), choices
        assert choices["onednn"] in ("AVX2", "AVX2_VNNI") and "faults on executing it" in choices["log"]
    if real["avx512_vnni"]:  # the kernels' VNNI build needs it, and so do oneDNN's VNNI kernels
        choices = child_choices(real | {"avx512_vnni": False})
        assert (choices["isa"], choices["onednn"]) == ("avx2", "AVX512_CORE"), choices
    if "avx2" in advertised:  # no probe passed at all: the portable kernels, torch at its floor
        choices = child_choices({})
        assert (choices["isa"], choices["bf16"]) == ("portable", False) and choices["aten"] == "default"
    # And the ceilings, for every class, whatever this machine is.
    runs = {"avx2": True, "avx512": True, "avx512_vnni": True, "avx512_bf16": True, "avx_vnni": True, "amx": False}
    assert isa_ceilings(runs.get) == ("AVX512_CORE_BF16", None)
    assert isa_ceilings((runs | {"avx512_bf16": False}).get) == ("AVX512_CORE_VNNI", None)
    assert isa_ceilings((runs | {"avx512_vnni": False}).get) == ("AVX512_CORE", None)
    assert isa_ceilings((runs | {"avx512": False}).get) == ("AVX2_VNNI", "avx2")
    assert isa_ceilings((runs | {"amx": True}).get) == ("ALL", None)
    assert isa_ceilings(lambda name: False) == ("SSE41", "default")
