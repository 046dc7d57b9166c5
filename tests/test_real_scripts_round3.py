"""Real training scripts, round 3 (issue 44 item 4): crashes and refusals that could not be
followed, each against the N models run one by one by stock PyTorch.

- graph convolution (pytorch/examples' gcn, Kipf's pygcn): ``torch.spmm(adj, support)``
  with ``adj`` a sparse COO matrix all models share (and sparse features ``x``) crashed in
  torch (``aten::as_strided`` on ``SparseCPU``): now one sparse product over the models'
  columns, or model by model where the sparse operand is each model's own.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from tests.equivalence import check_equivalence

N = 3
DTYPES = [torch.float64, torch.float32]


# --------------------------------------------------------------------------- graph convolution


def adjacency(nodes=7, seed=0):
    """A graph's normalised adjacency as gcn builds it: sparse COO, self-loops, D^-1 A."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.randint(0, nodes, (2, 3 * nodes), generator=g)
    loops = torch.arange(nodes).expand(2, nodes)
    indices = torch.cat([edges, edges.flip(0), loops], dim=1)
    dense = torch.zeros(nodes, nodes).index_put_(tuple(indices), torch.ones(indices.shape[1]))
    dense = dense / dense.sum(1, keepdim=True)
    return dense.to_sparse_coo().coalesce()


class GraphConvolution(nn.Module):
    """pygcn's layer: ``support = x @ W``, then ``adj @ support`` (sparse ``adj``)."""

    def __init__(self, in_features, out_features, bias=True, spmm=torch.spmm):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.spmm = spmm
        stdv = 1. / math.sqrt(self.weight.size(1))
        self.weight.data.uniform_(-stdv, stdv)
        if self.bias is not None:
            self.bias.data.uniform_(-stdv, stdv)

    def forward(self, input, adj):
        support = torch.mm(input, self.weight)
        output = self.spmm(adj, support)
        return output + self.bias if self.bias is not None else output


class GCN(nn.Module):
    """pygcn's two-layer GCN (``spmm=torch.sparse.mm``: pytorch/examples' gcn, dropout on
    the input features too)."""

    def __init__(self, nfeat=5, nhid=6, nclass=3, dropout=0.5, spmm=torch.spmm,
                 input_dropout=False):
        super().__init__()
        self.gc1 = GraphConvolution(nfeat, nhid, spmm=spmm)
        self.gc2 = GraphConvolution(nhid, nclass, spmm=spmm)
        self.dropout = dropout
        self.input_dropout = input_dropout

    def forward(self, x, adj):
        if self.input_dropout:
            x = F.dropout(x, self.dropout, training=self.training)
        x = F.relu(self.gc1(x, adj))
        x = F.dropout(x, self.dropout, training=self.training)
        x = self.gc2(x, adj)
        return F.log_softmax(x, dim=1)


class SparseFeatures(nn.Module):
    """A GCN layer on sparse node features: ``torch.mm(x_sparse, W)``, then ``adj @``."""

    def __init__(self, nfeat=5, nclass=3):
        super().__init__()
        self.gc = GraphConvolution(nfeat, nclass, spmm=torch.sparse.mm)

    def forward(self, x, adj):
        return self.gc(x, adj).tanh()


class DenseTimesSparse(nn.Module):
    """The sparse operand on the right: ``h^T @ adj`` (stacked rows, one shared matrix)."""

    def __init__(self, nfeat=5, nhid=4):
        super().__init__()
        self.lin = nn.Linear(nfeat, nhid)

    def forward(self, x, adj):
        return torch.mm(self.lin(x).t(), adj).t().sigmoid()


def dropout_free(train):
    """Train mode without dropout (its draws are tested elsewhere), eval mode with it."""
    return 0.0 if train else 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("spmm", [torch.spmm, torch.sparse.mm], ids=["spmm", "sparse.mm"])
def test_gcn_with_a_shared_sparse_adjacency_fuses_exactly(spmm, train, dtype):
    models = [GCN(dropout=dropout_free(train), spmm=spmm, input_dropout=spmm is torch.sparse.mm)
              for _ in range(N)]
    fused = check_equivalence(models, (torch.randn(7, 5), adjacency()), train=train,
                              dtype=dtype, check_input_grads=False)
    assert fused.fusion_report.fallbacks == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gcn_on_sparse_features_and_stacked_features(dtype):
    """Sparse features shared (``torch.mm(x_sparse, W)``), and each model's own dense
    features with the shared sparse adjacency."""
    x_sparse = (torch.randn(7, 5) * (torch.rand(7, 5) < 0.4)).to_sparse_coo()
    check_equivalence([SparseFeatures() for _ in range(N)], (x_sparse, adjacency()),
                      dtype=dtype, check_input_grads=False)
    check_equivalence([GCN(dropout=0.0) for _ in range(N)], (torch.randn(N, 7, 5), adjacency()),
                      in_dims=(0, None), dtype=dtype, check_input_grads=False)
    check_equivalence([DenseTimesSparse() for _ in range(N)], (torch.randn(7, 5), adjacency()),
                      dtype=dtype, check_input_grads=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gcn_with_each_models_own_sparse_adjacency_runs_model_by_model(dtype):
    """One graph per model (a stacked sparse ``[N, n, n]``): each model's product alone."""
    adj = torch.stack([adjacency(seed=i) for i in range(N)])
    check_equivalence([GCN(dropout=0.0) for _ in range(N)], (torch.randn(7, 5), adj),
                      in_dims=(None, 0), dtype=dtype, check_input_grads=False)


def test_gcn_gradient_of_a_sparse_adjacency_that_requires_one():
    """A shared sparse operand that requires a gradient gets the models' gradients summed
    (``torch.sparse.mm``: sparse, on the adjacency's pattern; ``torch.mm``: dense)."""
    for spmm in (torch.sparse.mm, torch.spmm):
        models = [GCN(dropout=0.0, spmm=spmm).double() for _ in range(N)]
        x, adj = torch.randn(7, 5, dtype=torch.float64), adjacency().double()
        fused = hftc.fuse(copy.deepcopy(models))
        adj_fused = adj.clone().requires_grad_()
        fused(x, adj_fused).sum().backward()
        adj_loop = adj.clone().requires_grad_()
        sum(m(x, adj_loop).sum() for m in models).backward()
        assert adj_fused.grad.layout == adj_loop.grad.layout
        torch.testing.assert_close(adj_fused.grad.to_dense(), adj_loop.grad.to_dense(),
                                   rtol=0, atol=1e-12)
