"""The llama.cpp peer is built for the instruction sets this CPU executes (bench/llamacpp_build.py): every
x86 extension named from the probes, never -march=native, and no AMX in the built library (an Intel VM's
AMX killed llama.cpp's native build with SIGILL, issue 48). `make test` installs it first."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from specpool.bench import llamacpp_build


def test_the_build_names_each_extension_from_the_probes():
    everything = llamacpp_build.isa_flags(lambda name: True)
    assert everything["GGML_AVX512_VNNI"] and everything["GGML_AVX512_BF16"] and everything["GGML_AVX2"]
    assert not any(on for name, on in everything.items() if name.startswith("GGML_AMX"))  # AMX runs, still off
    no_avx512 = llamacpp_build.isa_flags(lambda name: name != "avx512")  # advertised, but it faulted
    assert no_avx512["GGML_AVX2"] and not any(no_avx512[f] for f in ("GGML_AVX512", "GGML_AVX512_VNNI"))
    avx2_class = llamacpp_build.isa_flags(lambda name: True, avx2_class=True)  # SPECPOOL_NO_NATIVE_BF16
    assert avx2_class["GGML_AVX2"] and not avx2_class["GGML_AVX512"] and not avx2_class["GGML_AVX_VNNI"]
    assert not any(llamacpp_build.isa_flags(lambda name: False).values())
    assert "-DGGML_NATIVE=OFF" in llamacpp_build.planned()["cmake_args"]


def test_the_installed_peer_is_this_machines_build_and_holds_no_amx_instruction():
    installed = llamacpp_build.installed()
    if installed is None or not llamacpp_build.library_files():
        pytest.fail("the llama.cpp peer is not installed: run `make bench-deps`", pytrace=False)
    assert installed["key"] == llamacpp_build.planned()["key"], "installed for another machine class"
    assert installed["amx"] is False
    objdump = shutil.which("objdump")
    assert objdump, "objdump (Debian's binutils, beside the C compiler) is needed to read the built library"
    found = {}
    for library in llamacpp_build.library_files():
        if library.is_symlink():
            continue
        listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                                 timeout=300, check=True).stdout
        if library.name.startswith("libggml-cpu") and "avx512_vnni" in installed["isa"]:
            assert "\tvpdpbusd " in listing, "the listing shows no VNNI either: it is not reading the kernels"
        found |= {f"{library.name}: {op}" for op in llamacpp_build.AMX_INSTRUCTIONS if f"\t{op} " in listing}
    assert not found, sorted(found)


def test_the_speculative_binary_is_built_with_the_wheels_isa_flags_and_examples_on():
    """llama-speculative-simple (the bench's llamacpp-sd) gets the wheel's ISA flags, AMX still off, and is cached
    under a key of its own flags, apart from the wheel's."""
    wheel, spec = llamacpp_build.planned(), llamacpp_build.speculative_plan()
    isa = [f for f in wheel["cmake_args"] if f.startswith("-DGGML_")]
    assert all(f in spec["cmake_args"] for f in isa) and "-DGGML_NATIVE=OFF" in spec["cmake_args"]
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in spec["cmake_args"] and "-DLLAMA_BUILD_EXAMPLES=OFF" not in spec["cmake_args"]
    assert spec["amx"] is False and spec["key"] != wheel["key"]
