"""Distributed-parity stripe layout (RAID-6 style) over a group of G nodes that tolerates m lost nodes.

Every node's snapshot is padded to a common size S (a multiple of k*64, k = G - m) and cut into k
chunks of S/k bytes. There are G stripes. Stripe j keeps its m parity chunks on nodes j, j+1, ...,
j+m-1 (mod G) and takes one data chunk from each of the other k nodes: data block i of stripe j is
chunk i of node (j + m + i) mod G. So each node gives each of its k chunks to exactly one stripe and
holds parity for m stripes.

Why this layout:
- Parity is spread evenly: every node stores m chunks of S/k, i.e. parity memory = m/(G-m) of its own
  data, and does the same share of encoding work and traffic. Dedicated parity nodes (RAID-4 style)
  would need the whole group's parity memory on m nodes and make them the bottleneck.
- Any m nodes may be lost: each stripe has exactly one block on every node, so losing m nodes loses
  m blocks of every stripe, which RS(k, m) rebuilds from any k survivors.
- Memory is the minimum for m-loss tolerance (MDS code): m/(G-m) extra, against m full copies (m x)
  for replication that survives the same m losses.

Everything here works on in-memory buffers. Parity of one stripe is computed from its k data chunks
(`stripe_parity`), and `rebuild` asks a `fetch_chunk` callback for each surviving chunk it needs,
so a transport can serve chunks from remote nodes.
"""

from dataclasses import dataclass

import numpy as np

from inmem_ft.ec.codec import NotEnoughBlocks, RSCodec, as_u8

DATA = "data"
PARITY = "parity"
_ALIGN = 64  # bytes: every chunk starts on a cache line, so SIMD loads stay aligned and chunks share no line


class TooManyLost(NotEnoughBlocks):
    """More nodes of a group are lost than its parity tolerates."""


@dataclass(frozen=True)
class Stripe:
    index: int
    parity_nodes: tuple  # parity block p lives on parity_nodes[p]
    data: tuple  # data block i is chunk data[i][1] of node data[i][0]


@dataclass
class NodeRebuild:
    data: np.ndarray  # the node's padded data, S bytes
    parity: list  # its parity chunks, in the order of StripeLayout.parity_for_node(node)


class StripeLayout:
    def __init__(self, G, m):
        if not isinstance(G, int) or not isinstance(m, int) or m < 1 or m >= G:
            raise ValueError(f"StripeLayout: need integers with 1 <= m < G, got G={G!r}, m={m!r}")
        if G > 255:
            raise ValueError(f"StripeLayout: a group has at most 255 nodes (GF(2^8) Reed-Solomon), got G={G}")
        self.G, self.m, self.k = G, m, G - m
        self.codec = RSCodec(self.k, m)
        self.stripes = tuple(
            Stripe(
                index=j,
                parity_nodes=tuple((j + p) % G for p in range(m)),
                data=tuple(((j + m + i) % G, i) for i in range(self.k)),
            )
            for j in range(G)
        )

    def __repr__(self):
        return f"StripeLayout(G={self.G}, m={self.m})"

    def padded_size(self, max_len):
        """The common per-node size S for data of at most `max_len` bytes: a multiple of k*64."""
        if max_len < 0:
            raise ValueError(f"{self}: max_len must be >= 0, got {max_len}")
        unit = self.k * _ALIGN
        return -(-max_len // unit) * unit

    def chunk_size(self, size):
        """S/k for a padded size S, or an error saying how to pad."""
        if size % (self.k * _ALIGN):
            raise ValueError(
                f"{self}: {size} bytes is not a padded size (a multiple of k*64 = {self.k * _ALIGN}); "
                f"pad every node's data with pad_to(buf, layout.padded_size(max_len))"
            )
        return size // self.k

    def parity_for_node(self, node):
        """[(stripe, parity_index)] held by `node`, m of them."""
        self._check_node(node)
        return [((node - p) % self.G, p) for p in range(self.m)]

    def data_stripe(self, node, c):
        """The stripe whose data block c is `node`'s chunk c (the inverse of Stripe.data)."""
        self._check_node(node)
        return (node - self.m - c) % self.G

    def _check_node(self, node):
        if not isinstance(node, (int, np.integer)) or not 0 <= node < self.G:
            raise ValueError(f"{self}: node {node!r} is outside 0..{self.G - 1}")


def pad_to(buf, size):
    """`buf` as a uint8 array of `size` bytes: a view when it already has that size, else a zero-padded copy."""
    arr = as_u8(buf, "buf")
    if arr.nbytes == size:
        return arr
    if arr.nbytes > size:
        raise ValueError(f"pad_to: buffer holds {arr.nbytes} bytes, more than the padded size {size}")
    out = np.zeros(size, dtype=np.uint8)
    out[: arr.nbytes] = arr
    return out


def chunk(layout, buf, index):
    """View of chunk `index` (0..k-1) of a node's padded buffer."""
    arr = as_u8(buf, "buf")
    cs = layout.chunk_size(arr.nbytes)
    return arr[index * cs : (index + 1) * cs]


def stripe_parity(layout, stripe, data_chunks, parity_indices=None, out=None):
    """Parity chunks of stripe `stripe` from its k data chunks (in Stripe.data order)."""
    if not 0 <= stripe < layout.G:
        raise ValueError(f"{layout}: stripe {stripe} is outside 0..{layout.G - 1}")
    return layout.codec.encode(data_chunks, out, parity_indices)


def encode_node_parity(layout, node_data, node, out=None):
    """The m parity chunks `node` holds, in parity_for_node order, from the padded data of the nodes
    in its stripes (`node_data`: node -> buffer; every buffer the same padded size)."""
    held = layout.parity_for_node(node)
    if out is not None and len(out) != len(held):
        raise ValueError(f"{layout}: node {node} holds {len(held)} parity chunks, `out` has {len(out)}")
    size = None
    result = []
    for n, (j, p) in enumerate(held):
        chunks = []
        for member, c in layout.stripes[j].data:
            if member not in node_data:
                raise KeyError(f"{layout}: parity of stripe {j} (held by node {node}) needs node {member}'s data")
            buf = node_data[member]
            nbytes = as_u8(buf, f"node_data[{member}]").nbytes
            if size is None:
                size = nbytes
            elif nbytes != size:
                raise ValueError(
                    f"{layout}: node {member}'s data is {nbytes} bytes, others are {size}; "
                    f"pad every node to the same size with pad_to(buf, layout.padded_size(max_len))"
                )
            chunks.append(chunk(layout, buf, c))
        dst = None if out is None else [out[n]]
        result.extend(stripe_parity(layout, j, chunks, [p], dst))
    return result


def _empty_node(layout, chunk_size):
    return NodeRebuild(
        np.empty(chunk_size * layout.k, dtype=np.uint8),
        [np.empty(chunk_size, dtype=np.uint8) for _ in range(layout.m)],
    )


def rebuild(layout, lost_nodes, fetch_chunk):
    """Rebuilds the data and parity of `lost_nodes` bit-exactly: {node: NodeRebuild}.

    `fetch_chunk(node, kind, index)` returns a surviving node's chunk: kind DATA with a chunk index,
    or kind PARITY with a stripe index. Each stripe fetches k chunks, data chunks first.
    """
    lost = sorted(set(lost_nodes))
    for node in lost:
        layout._check_node(node)
    if len(lost) > layout.m:
        raise TooManyLost(
            f"nodes {lost} of an EC group of G={layout.G} nodes are lost, but its parity m={layout.m} "
            f"tolerates at most {layout.m}: the in-memory snapshot cannot be rebuilt; "
            f"restore it from the next tier (disk)"
        )
    rebuilt = {}
    chunk_size = None
    for stripe in layout.stripes:
        members = [(i, node, DATA, c) for i, (node, c) in enumerate(stripe.data)]
        members += [(layout.k + p, node, PARITY, stripe.index) for p, node in enumerate(stripe.parity_nodes)]
        survivors = [mb for mb in members if mb[1] not in lost][: layout.k]
        missing = [mb for mb in members if mb[1] in lost]
        if not missing:
            continue
        blocks = {}
        for block, node, kind, idx in survivors:
            arr = as_u8(fetch_chunk(node, kind, idx), f"fetch_chunk({node}, {kind!r}, {idx})")
            if chunk_size is None:
                # The first chunk fixes the size; outputs are allocated once and decoded into in place.
                chunk_size = arr.nbytes
                layout.chunk_size(chunk_size * layout.k)
                rebuilt = {n: _empty_node(layout, chunk_size) for n in lost}
            elif arr.nbytes != chunk_size:
                raise ValueError(
                    f"{layout}: fetch_chunk({node}, {kind!r}, {idx}) returned {arr.nbytes} bytes, "
                    f"earlier chunks were {chunk_size}"
                )
            blocks[block] = arr
        out = {}
        for block, node, kind, idx in missing:
            target = rebuilt[node]
            if kind == DATA:
                out[block] = target.data[idx * chunk_size : (idx + 1) * chunk_size]
            else:
                # Node (j + p) holds parity p of stripe j, which is entry p of its parity_for_node list.
                out[block] = target.parity[block - layout.k]
        layout.codec.decode(blocks, list(out), out)
    return rebuilt
