"""Real training scripts, round 3 (issue 44 item 4): crashes and refusals that could not be
followed, each against the N models run one by one by stock PyTorch.

- graph convolution (pytorch/examples' gcn, Kipf's pygcn): ``torch.spmm(adj, support)``
  with ``adj`` a sparse COO matrix all models share (and sparse features ``x``) crashed in
  torch (``aten::as_strided`` on ``SparseCPU``): now one sparse product over the models'
  columns, or model by model where the sparse operand is each model's own.
- kuangliu/pytorch-cifar's ShuffleNetV2 (channel split and shuffle, depthwise convs, three
  stride-2 stages, ``F.avg_pool2d(out, 4)``, ``out.view(out.size(0), -1)``, a Linear):
  torch.export with every dim symbolic failed inside sympy; now the batch dim alone is
  symbolic (static shapes where that fails too), recorded, and a call with another image
  size refused naming the input, the shape exported and what to do.
- pytorch/examples' mnist_forward_forward: ``class Layer(nn.Linear)`` whose ``train(self,
  x_pos, x_neg)`` is its training loop; hftc called ``model.train(True)`` and refused.
- lucidrains/vit-pytorch's ViT with ``pool='cls'`` against one with ``pool='mean'``: refused
  rightly, now naming the user's line (``x.mean(dim = 1) if ... else x[:, 0]``), not a
  guard node of hftc's, with both front-ends.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from hftc.errors import FusionTypeError, InputShapeError, MismatchError
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
@pytest.mark.parametrize("spmm", [torch.spmm, torch.sparse.mm], ids=["spmm", "sparse.mm"])
def test_gcn_exported_with_a_sparse_example_input_fuses_exactly(spmm, dtype):
    """Through torch.export (``example_inputs`` with the sparse adjacency): exported from a
    copy of each example input, which a sparse one must be made without ``preserve_format``,
    and ``aten._sparse_mm`` spelled ``torch.sparse.mm`` for the rule."""
    x, adj = torch.randn(7, 5), adjacency()

    def fuser(models, in_dims=None):
        return hftc.fuse(models, in_dims=in_dims, frontend="export",
                         example_inputs=(x.to(dtype), adj.to(dtype)))

    fused = check_equivalence([GCN(dropout=0.0, spmm=spmm) for _ in range(N)], (x, adj),
                              dtype=dtype, fuser=fuser, check_input_grads=False)
    assert fused.frontend == "export"
    assert fused.fusion_report.fallbacks == []  # (aten._sparse_mm is fuse_matmul's too)


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
def test_gcn_with_a_csr_adjacency_fuses_exactly(dtype):
    adj = adjacency().to_sparse_csr()
    for spmm in (torch.spmm, torch.sparse.mm):
        check_equivalence([GCN(dropout=0.0, spmm=spmm) for _ in range(N)],
                          (torch.randn(7, 5), adj), dtype=dtype, check_input_grads=False)
    check_equivalence([DenseTimesSparse() for _ in range(N)], (torch.randn(7, 5), adj),
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


# --------------------------------------------------------------------------- ShuffleNetV2


class ShuffleBlock(nn.Module):
    def __init__(self, groups=2):
        super().__init__()
        self.groups = groups

    def forward(self, x):
        N, C, H, W = x.size()
        g = self.groups
        return x.view(N, g, C // g, H, W).permute(0, 2, 1, 3, 4).reshape(N, C, H, W)


class SplitBlock(nn.Module):
    def __init__(self, ratio):
        super().__init__()
        self.ratio = ratio

    def forward(self, x):
        c = int(x.size(1) * self.ratio)  # (a size in Python: symbolic tracing stops here)
        return x[:, :c, :, :], x[:, c:, :, :]


def conv_bn(cin, cout, kernel=1, stride=1, groups=1):
    return nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups,
                     bias=False), nn.BatchNorm2d(cout)


class BasicBlock(nn.Module):
    def __init__(self, in_channels, split_ratio=0.5):
        super().__init__()
        self.split = SplitBlock(split_ratio)
        c = int(in_channels * split_ratio)
        self.conv1, self.bn1 = conv_bn(c, c)
        self.conv2, self.bn2 = conv_bn(c, c, 3, groups=c)
        self.conv3, self.bn3 = conv_bn(c, c)
        self.shuffle = ShuffleBlock()

    def forward(self, x):
        x1, x2 = self.split(x)
        out = F.relu(self.bn1(self.conv1(x2)))
        out = self.bn2(self.conv2(out))
        out = F.relu(self.bn3(self.conv3(out)))
        return self.shuffle(torch.cat([x1, out], 1))


class DownBlock(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        mid = out_channels // 2
        self.conv1, self.bn1 = conv_bn(in_channels, in_channels, 3, 2, groups=in_channels)
        self.conv2, self.bn2 = conv_bn(in_channels, mid)
        self.conv3, self.bn3 = conv_bn(in_channels, mid)
        self.conv4, self.bn4 = conv_bn(mid, mid, 3, 2, groups=mid)
        self.conv5, self.bn5 = conv_bn(mid, mid)
        self.shuffle = ShuffleBlock()

    def forward(self, x):
        out1 = self.bn1(self.conv1(x))
        out1 = F.relu(self.bn2(self.conv2(out1)))
        out2 = F.relu(self.bn3(self.conv3(x)))
        out2 = self.bn4(self.conv4(out2))
        out2 = F.relu(self.bn5(self.conv5(out2)))
        return self.shuffle(torch.cat([out1, out2], 1))


class ShuffleNetV2(nn.Module):
    """pytorch-cifar's ShuffleNetV2 at a small width: 32x32 images, three stride-2 stages
    (4x4 left), ``avg_pool2d(out, 4)``, flattened into the Linear (which pins H and W)."""

    def __init__(self, out_channels=(8, 16, 16, 32), num_blocks=(1, 1, 1), num_classes=5):
        super().__init__()
        self.conv1, self.bn1 = conv_bn(3, 8, 3)
        self.in_channels = 8
        self.layer1 = self._make_layer(out_channels[0], num_blocks[0])
        self.layer2 = self._make_layer(out_channels[1], num_blocks[1])
        self.layer3 = self._make_layer(out_channels[2], num_blocks[2])
        self.conv2, self.bn2 = conv_bn(out_channels[2], out_channels[3])
        self.linear = nn.Linear(out_channels[3], num_classes)

    def _make_layer(self, out_channels, num_blocks):
        layers = [DownBlock(self.in_channels, out_channels)]
        for _ in range(num_blocks):
            layers.append(BasicBlock(out_channels))
            self.in_channels = out_channels
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer1(out)
        out = self.layer2(out)
        out = self.layer3(out)
        out = F.relu(self.bn2(self.conv2(out)))
        out = F.avg_pool2d(out, 4)
        out = out.view(out.size(0), -1)
        return self.linear(out)


def fuse_with_example(example, frontend="auto"):
    """``check_equivalence``'s fuser: ``hftc.fuse`` given ``example_inputs`` (cast to the
    models' dtype, as the harness casts the models before fusing)."""
    def fuser(models, in_dims=None):
        dtype = next(models[0].parameters()).dtype
        return hftc.fuse(models, in_dims=in_dims, frontend=frontend,
                         example_inputs=(example.to(dtype),))
    return fuser


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shufflenet_v2_is_exported_with_a_dynamic_batch_and_fuses_exactly(dtype):
    """Symbolic tracing stops at ``int(x.size(1) * ratio)``; torch.export with every dim
    symbolic failed inside sympy (``Eq(32*((x/8)//4) - 32, 0)`` cannot be solved), which
    hftc reported as "check that example_inputs are valid".  The batch dim alone is
    symbolic now: the models fuse, forward and backward equal, in train and eval mode."""
    models = [ShuffleNetV2() for _ in range(2)]
    x = torch.randn(4, 3, 32, 32)
    fused = check_equivalence(models, x, dtype=dtype, fuser=fuse_with_example(x))
    assert fused.frontend == "export"
    report = str(fused.fusion_report)
    assert "exported with the leading (batch) dim only symbolic: torch.export could not keep " \
        "every dim symbolic" in report, report
    fused.eval()
    other_batch = torch.randn(3, 3, 32, 32, dtype=dtype)
    out = fused(other_batch)  # (the batch dim is symbolic: no export again)
    assert not fused.__dict__.get("_reexported_graphs")
    for i, m in enumerate(models):
        m = copy.deepcopy(m).to(dtype).eval()
        m.load_state_dict(fused.model_state_dict(i))
        torch.testing.assert_close(out[i], m(other_batch), rtol=0,
                                   atol=1e-12 if dtype == torch.float64 else 1e-5)


def test_shufflenet_v2_at_another_image_size_is_refused_naming_the_input_and_the_shape():
    """The Linear takes 32 features, 32x32 images' worth: a 64x64 call is exported again and
    fails in the models' own code; the error names the input, its shape, the shape
    exported, how, and where the models fail, and says what to do."""
    models = [ShuffleNetV2() for _ in range(2)]
    fused = hftc.fuse(models, example_inputs=(torch.randn(4, 3, 32, 32),))
    with pytest.raises(InputShapeError) as info:
        fused(torch.randn(4, 3, 64, 64))
    message = str(info.value)
    for part in ("input `x` has shape [4, 3, 64, 64]", "with shape [*, 3, 32, 32]",
                 "exported with the leading (batch) dim only symbolic",
                 "Call with that shape, or fuse again", "the models' own code fails",
                 "in forward: `return self.linear(out)`"):
        assert part in message, (part, message)


class SimilarityHead(nn.Module):
    """A CNN over the batch's similarity map (``x @ x.T``, ``[B, B]``, as a relation head
    scores every pair): strided convs, ``avg_pool2d(out, 4)``, flattened into a Linear,
    which pins B through both dims of the map; neither every dim nor the batch dim alone
    exports symbolic, static shapes do."""

    def __init__(self):
        super().__init__()
        self.convs = nn.Sequential(nn.Conv2d(1, 4, 3, 2, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, 2, 1),
                                   nn.ReLU(), nn.Conv2d(4, 8, 3, 2, 1))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        similarity = (x @ x.t())[None, None]
        out = F.avg_pool2d(self.convs(similarity), 4)
        return self.fc(out.view(out.size(0), -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_model_whose_batch_size_is_pinned_is_exported_with_static_shapes(dtype):
    """The batch dim alone failed too (sympy again), and the static try failed with the
    same error on the same example tensor (torch.export keeps state on it): static shapes
    export from a copy, the models fuse exactly, and another batch size is refused."""
    models = [SimilarityHead() for _ in range(N)]
    x = torch.randn(32, 6)
    fused = check_equivalence(models, x, dtype=dtype, fuser=fuse_with_example(x, "export"))
    assert "exported with static shapes (the example inputs' sizes): torch.export could " \
        "not keep every dim symbolic" in str(fused.fusion_report)
    with pytest.raises(InputShapeError, match=r"input `x` has shape \[16, 6\], but the models "
                       r"were exported .* with shape \[32, 6\]: exported with static shapes"):
        fused(torch.randn(16, 6, dtype=dtype))


# --------------------------------------------------------------------------- forward-forward


class Layer(nn.Linear):
    """The forward-forward layer: ``train`` takes positive and negative data and trains it."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__(in_features, out_features, bias)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
        self.threshold = 2.0
        self.num_epochs = 2

    def forward(self, x):
        x_direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(x_direction, self.weight.T) + self.bias.unsqueeze(0))

    def train(self, x_pos, x_neg):
        for _ in range(self.num_epochs):
            g_pos = self.forward(x_pos).pow(2).mean(1)
            g_neg = self.forward(x_neg).pow(2).mean(1)
            loss = torch.log(1 + torch.exp(torch.cat([-g_pos + self.threshold,
                                                      g_neg - self.threshold]))).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return self.forward(x_pos).detach(), self.forward(x_neg).detach()


class Net(nn.Module):
    """The forward-forward net: its layers, each trained by its own ``train``."""

    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList([Layer(dims[d], dims[d + 1]) for d in range(len(dims) - 1)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


FORWARD_FORWARD = {"layer": lambda: Layer(6, 5), "net": lambda: Net([6, 5, 4])}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", list(FORWARD_FORWARD))
def test_forward_forward_layer_with_its_own_train_fuses(kind, train, dtype):
    """``model.train(True)`` ran the layer's training loop (``missing argument 'x_neg'``)
    and the fusion was refused: the modes are now set as flags, the models fuse, and
    forward and backward equal the models'."""
    models = [FORWARD_FORWARD[kind]() for _ in range(N)]
    check_equivalence(models, torch.randn(4, 6), train=train, dtype=dtype)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_fused_train_and_eval_switch_every_model_without_the_models_train(frontend):
    models = [Net([6, 5, 4]) for _ in range(N)]
    x = torch.randn(4, 6)
    fused = hftc.fuse(copy.deepcopy(models), frontend=frontend, example_inputs=(x,))
    assert fused.eval() is fused
    assert not any(m.training for m in fused.modules())
    out = fused(x)
    for i, m in enumerate(models):
        for sub in m.modules():
            sub.training = False
        torch.testing.assert_close(out[i], m(x), rtol=0, atol=1e-6)
    fused.train()
    assert all(m.training for m in fused.modules())
    assert torch.equal(fused(x), out)  # (no dropout or norm: the same in both modes)


def test_the_models_own_train_is_not_fused():
    """``fused.train(x_pos, x_neg)``: the layer's training loop is not one hftc fuses (it
    steps the layer's own optimizer); refused saying so, and what to do."""
    fused = hftc.fuse([Layer(6, 5) for _ in range(N)])
    x_pos, x_neg = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(FusionTypeError, match=r"Layer\.train is the models' own method") as info:
        fused.train(x_pos, x_neg)
    assert "fused.unfuse()" in str(info.value)
    with pytest.raises(FusionTypeError, match="takes one bool"):
        fused.train(x_pos)
    assert fused.training  # left as it was


# --------------------------------------------------------------------------- vit-pytorch


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden_dim), nn.GELU(),
                                 nn.Linear(hidden_dim, dim))

    def forward(self, x):
        return self.net(x)


class ViTAttention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=4):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = nn.LayerNorm(dim)
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(dim, dim_head * heads * 3, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim)

    def forward(self, x):
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class ViT(nn.Module):
    """vit-pytorch's ``ViT``: patches (its ``Rearrange``), a class token, ``depth`` blocks,
    then ``pool`` (the class token's row or the mean over the tokens) and the head."""

    def __init__(self, *, pool, image_size=8, patch_size=4, dim=8, depth=1, num_classes=5):
        super().__init__()
        self.patch = patch_size
        patch_dim = 3 * patch_size ** 2
        num_patches = (image_size // patch_size) ** 2
        self.to_patch_embedding = nn.Sequential(nn.LayerNorm(patch_dim),
                                                nn.Linear(patch_dim, dim), nn.LayerNorm(dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, num_patches + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.layers = nn.ModuleList([nn.ModuleList([ViTAttention(dim), FeedForward(dim, 2 * dim)])
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.pool = pool
        self.to_latent = nn.Identity()
        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, img):
        b, c, h, w = img.shape
        p = self.patch
        x = img.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1)
        x = self.to_patch_embedding(x.reshape(b, (h // p) * (w // p), p * p * c))
        b, n, _ = x.shape
        x = torch.cat((self.cls_token.expand(b, -1, -1), x), dim=1)
        x = x + self.pos_embedding[:, :(n + 1)]
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        x = self.norm(x)
        x = x.mean(dim = 1) if self.pool == 'mean' else x[:, 0]
        x = self.to_latent(x)
        return self.mlp_head(x)


@pytest.mark.parametrize("frontend", ["symbolic", "export"])
def test_vit_cls_and_mean_pooling_refused_naming_the_pooling_line(frontend):
    """The two poolings are two programs (refused rightly); the message names the line of
    vit-pytorch's forward that picks the pooling, its file and code, and the two ops."""
    models = [ViT(pool="cls"), ViT(pool="mean")]
    x = torch.randn(2, 3, 8, 8)
    with pytest.raises(MismatchError) as info:
        hftc.fuse(models, frontend=frontend, example_inputs=(x,))
    message = str(info.value)
    assert "check_input_shape" not in message
    assert "mean" in message and "getitem" in message
    line = next(k for k, text in enumerate(open(__file__).read().splitlines(), start=1)
                if "x = x.mean(dim = 1) if self.pool == 'mean' else x[:, 0]" in text)
    assert f"test_real_scripts_round3.py:{line} in forward: `x = x.mean(dim = 1) if " \
        f"self.pool == 'mean' else x[:, 0]" in message, message

class ImageHead(nn.Module):
    """pytorch/examples' mnist MLP flattens the image (``x.view(x.size(0), -1)``, which
    fixes C, H and W for export); a pooled head averages it (which fixes C only)."""

    def __init__(self, flatten):
        super().__init__()
        self.flatten = flatten
        self.fc = nn.Linear(3 * 8 * 8 if flatten else 3, 5)

    def forward(self, x):
        h = x.view(x.size(0), -1) if self.flatten else x.mean(dim=(2, 3))
        return self.fc(h)


def test_a_mismatch_is_looked_for_past_the_exported_input_guards():
    """The two heads' exports fix different input sizes, so their first nodes, hftc's
    input guards, differed: the message named ``check_input_shape``'s argument 1, which
    the user never wrote.  It names the layers that differ now."""
    with pytest.raises(MismatchError) as info:
        hftc.fuse([ImageHead(False), ImageHead(True)], frontend="export",
                  example_inputs=(torch.randn(2, 3, 8, 8),))
    message = str(info.value)
    assert "check_input_shape" not in message, message
    assert "model 1's `fc` (nn.Linear) differs from model 0's: in_features 192 vs 3" in message

