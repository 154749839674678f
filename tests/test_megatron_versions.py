"""inmem_ft/integrations/megatron/versions.py: the part that needs no megatron-core, where a torch_dist
checkpoint keeps its common state by the release that took the snapshot (what `inmem-ft export --format
megatron-dist` writes). The rest runs on each release in make test-compat (tests/compat/matrix.toml)."""
import pytest

from inmem_ft.integrations.megatron import versions


@pytest.mark.parametrize("release, file", [("0.17.1", "common.pt"), ("0.18.2", "common.pt"),
                                           ("0.18.3+abc1234", "common.pt"), ("0.19.2", None), ("0.20.0", None)])
def test_common_state_file_by_release(release, file):
    assert versions.common_state_file(release) == file
