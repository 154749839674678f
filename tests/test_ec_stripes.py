"""Stripe layout over G nodes: any <= m lost nodes rebuild byte-identical; m+1 are refused."""

import itertools

import numpy as np
import pytest

from inmem_ft.ec.stripes import (
    DATA,
    PARITY,
    StripeLayout,
    TooManyLost,
    chunk,
    encode_node_parity,
    pad_to,
    rebuild,
)


def _group(layout, lengths, seed=0):
    """Padded data and parity of every node, from random data of the given lengths."""
    rng = np.random.default_rng(seed)
    size = layout.padded_size(max(lengths))
    data = {n: pad_to(rng.integers(0, 256, ln, dtype=np.uint8), size) for n, ln in enumerate(lengths)}
    parity = {n: encode_node_parity(layout, data, n) for n in range(layout.G)}
    return data, parity


def _fetcher(layout, data, parity, lost):
    def fetch(node, kind, index):
        assert node not in lost, f"rebuild asked lost node {node} for a chunk"
        if kind == DATA:
            return chunk(layout, data[node], index)
        assert kind == PARITY
        return parity[node][[j for j, _ in layout.parity_for_node(node)].index(index)]

    return fetch


@pytest.mark.parametrize("m", [1, 2])
def test_layout_shape(m):
    layout = StripeLayout(4, m)
    k = 4 - m
    contributions = sorted((node, c) for s in layout.stripes for node, c in s.data)
    assert contributions == [(n, c) for n in range(4) for c in range(k)]  # each chunk exactly once
    for s in layout.stripes:
        assert s.parity_nodes == tuple((s.index + p) % 4 for p in range(m))
        assert not set(s.parity_nodes) & {node for node, _ in s.data}
    for n in range(4):
        held = layout.parity_for_node(n)
        assert len(held) == m
        assert all(layout.stripes[j].parity_nodes[p] == n for j, p in held)


@pytest.mark.parametrize("m", [1, 2])
def test_every_loss_of_at_most_m_nodes_rebuilds_exactly(m):
    layout = StripeLayout(4, m)
    data, parity = _group(layout, [1000, 777, 1, 1024])
    for r in range(m + 1):
        for lost in itertools.combinations(range(4), r):
            got = rebuild(layout, lost, _fetcher(layout, data, parity, lost))
            assert sorted(got) == list(lost)
            for n in lost:
                assert got[n].data.tobytes() == data[n].tobytes(), f"data of node {n}, lost {lost}"
                for have, want in zip(got[n].parity, parity[n]):
                    assert have.tobytes() == want.tobytes(), f"parity of node {n}, lost {lost}"


@pytest.mark.parametrize("m", [1, 2])
def test_m_plus_one_lost_raises_naming_nodes(m):
    layout = StripeLayout(4, m)
    lost = list(range(m + 1))
    with pytest.raises(TooManyLost) as err:
        rebuild(layout, lost, lambda *a: pytest.fail("must not fetch"))
    msg = str(err.value)
    assert str(lost) in msg and "G=4" in msg and f"m={m}" in msg and "disk" in msg


@pytest.mark.parametrize("m", [1, 2])
def test_parity_memory_is_m_over_k_of_padded_data(m):
    layout = StripeLayout(4, m)
    k = 4 - m
    data, parity = _group(layout, [5000, 4000, 3000, 100])
    size = layout.padded_size(5000)
    assert size % (k * 64) == 0 and 5000 <= size < 5000 + k * 64
    for n in range(4):
        assert sum(p.nbytes for p in parity[n]) * k == m * data[n].nbytes


def test_unpadded_data_is_refused_with_a_hint():
    layout = StripeLayout(4, 2)
    data = {n: np.zeros(1000, dtype=np.uint8) for n in range(4)}
    with pytest.raises(ValueError, match="pad_to"):
        encode_node_parity(layout, data, 0)


@pytest.mark.parametrize("G, m", [(4, 0), (4, 4), (1, 1), (300, 2)])
def test_bad_group_raises(G, m):
    with pytest.raises(ValueError, match="StripeLayout"):
        StripeLayout(G, m)
