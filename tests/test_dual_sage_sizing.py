import ast
import pathlib

import pytest

from h3_multigpu.dual_sage import sizing

GIB = 1 << 30
LAB = dict(link_gbps=300.0, tflops=(600.0, 600.0))


def test_sizing_imports_no_torch():
    source = pathlib.Path(sizing.__file__).read_text()
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in getattr(node, "names", [])}
    modules = {node.module.split(".")[0] for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.ImportFrom) and node.module}
    assert "torch" not in imported | modules


def test_bytes_moved_match_the_h3_facts():
    # 28 heads there and back in bf16: 28,672 bytes per token (21,504 out, 7,168 back)
    assert sizing.bytes_moved_per_call(68_706, 28, 128) == 28_672 * 68_706


def test_helper_workspace_is_bounded_by_the_ring():
    at_68k = sizing.helper_workspace_bytes(68_706, 28, 128)
    assert at_68k <= 1.6 * GIB
    # more helper heads do not grow the ring; more slots or bigger chunks do
    assert sizing.helper_workspace_bytes(68_706, 56, 128) == at_68k
    assert sizing.helper_workspace_bytes(68_706, 28, 128, ring_slots=6) > at_68k
    assert sizing.helper_workspace_bytes(68_706, 28, 128, chunk_heads=7) > at_68k
    assert sizing.root_extra_bytes(68_706, 28, 128) == 4 * 28 * 68_706 * 128 * 2


def test_predicted_split_speedup_is_near_two_on_nvlink_and_lower_through_the_host():
    single = sizing.single_gpu_ms(68_706, 56, 128, 600.0)
    peer = sizing.predict_split_ms(68_706, 128, (28, 28), **LAB)
    host = sizing.predict_split_ms(68_706, 128, (28, 28), link_gbps=25.0, tflops=(600, 600),
                                   host_relay=True)
    assert 1.85 < single / peer <= 2.0
    assert 1.0 < single / host < single / peer


def test_min_tokens_is_the_crossover():
    peer = sizing.choose_min_tokens(128, (28, 28), **LAB)
    host = sizing.choose_min_tokens(128, (28, 28), link_gbps=25.0, tflops=(600, 600),
                                    host_relay=True)
    assert 512 < peer < host < 68_706  # short text calls stay home; PASS2 always splits

    def pays(s, **kw):
        single = sizing.single_gpu_ms(s, 56, 128, kw["tflops"][0])
        return sizing.predict_split_ms(s, 128, (28, 28), **kw) * sizing.MIN_TOKENS_MARGIN \
            <= single

    assert pays(peer, **LAB) and not pays(peer - 1, **LAB)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="one entry per device"):
        sizing.predict_split_ms(1000, 128, (28, 28), link_gbps=300, tflops=(600,))
