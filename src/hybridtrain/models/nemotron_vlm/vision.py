"""RADIO-style vision transformer with dynamic resolution, pixel shuffle and the MLP projector.

Images of different sizes travel as one packed sequence: ``pixel_values`` [P_total, C*p*p]
(each image's patches in row-major order, flattened channel-major as
:func:`hybridtrain.data.images.patchify` writes them) and ``image_grid`` [N, 2] (patch rows,
patch columns of each image). The ViT inserts ``class_token_len`` class tokens before every
image's patches, adds position embeddings interpolated (bilinear, ``align_corners=False``) to
each image's own grid, and attends within each image only: images with the same token count
go through one unmasked attention call as a batch [images, heads, tokens, dim] (what a
block-diagonal mask over all tokens computes, to rounding, without its cost quadratic in the
micro-batch's tokens: 2026-11-26, vlm_tiny's ViT on 60 images, fwd+bwd 0.88 -> 0.036 CPU-s).
Class tokens are dropped at the end; :func:`pixel_shuffle` merges 2x2 neighbouring patches of
each image (4x fewer tokens, 4x channels) and the projector maps them to the language model's
width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtrain.models.nemotron_h.norms import RMSNorm

from .config import NemotronVLMConfig, VisionConfig


def image_cu_seqlens(image_grid: torch.Tensor, extra: int = 0) -> torch.Tensor:
    """Cumulative token counts [N + 1] of the packed images (``extra`` tokens added per image)."""
    sizes = image_grid[:, 0].long() * image_grid[:, 1].long() + extra
    return F.pad(torch.cumsum(sizes, 0), (1, 0))


ImageGroups = list[tuple[torch.Tensor, int, int]]


def same_length_groups(cu_seqlens: torch.Tensor) -> tuple[ImageGroups, torch.Tensor | None]:
    """Images grouped by token count: ``[(rows, n_images, length)]`` with ``rows`` the packed
    positions of the group's tokens (image by image), and the permutation that puts the groups'
    concatenated rows back in packed order (``None`` when it is the identity)."""
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for i in range(len(bounds) - 1):
        by_length.setdefault(bounds[i + 1] - bounds[i], []).append(bounds[i])
    groups, order = [], []
    for length, starts in by_length.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten()
        groups.append((rows.to(cu_seqlens.device), len(starts), length))
        order.append(rows)
    if len(groups) <= 1:
        return groups, None
    return groups, torch.argsort(torch.cat(order)).to(cu_seqlens.device)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, groups: ImageGroups,
                unpermute: torch.Tensor | None) -> torch.Tensor:
        T, D = x.shape
        qkv = self.qkv(x).view(T, 3, self.num_heads, D // self.num_heads)
        outs = []
        for rows, n, length in groups:  # [n*L, 3, H, d] -> 3 x [n, H, L, d]
            g = qkv if len(groups) == 1 else qkv[rows]
            q, k, v = g.view(n, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            outs.append(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, D))
        o = outs[0] if len(outs) == 1 else torch.cat(outs) if outs else x
        return self.proj(o if unpermute is None else o[unpermute])


class VisionBlock(nn.Module):
    """Pre-norm block: x + attn(norm1(x)), then x + mlp(norm2(x)) (GELU MLP); with
    ``config.layer_scale`` each branch is scaled per channel (``layer_scale1`` / ``2``)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        if config.layer_scale:
            self.layer_scale1 = nn.Parameter(torch.ones(config.hidden_size))
            self.layer_scale2 = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: torch.Tensor, groups: ImageGroups,
                unpermute: torch.Tensor | None) -> torch.Tensor:
        a = self.attn(self.norm1(x), groups, unpermute)
        x = x + (a * self.layer_scale1 if hasattr(self, "layer_scale1") else a)
        m = self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x + (m * self.layer_scale2 if hasattr(self, "layer_scale2") else m)


class RadioViT(nn.Module):
    """``forward(pixel_values, image_grid) -> [P_total, D]``: the patch tokens of every image
    (class tokens dropped), in the input's order."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.patch_embed = nn.Linear(config.patch_dim, D, bias=config.patch_bias)
        n_pos = config.pos_grid * config.pos_grid  # RADIO's own shape [1, n, D] under crop
        shape = (1, n_pos, D) if config.pos_interpolation == "crop" else (n_pos, D)
        self.pos_embed = nn.Parameter(torch.empty(shape))
        self.cls_token = nn.Parameter(torch.empty(config.class_token_len, D))
        self.blocks = nn.ModuleDict({str(i): VisionBlock(config)
                                     for i in range(config.num_hidden_layers)})
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps) if config.final_norm else None
        # carried through (saved, never trained): a video patch projection and RADIO's summary
        # indices, so that an export holds every tensor of the checkpoint it came from
        if config.video_patch_dim:
            self.register_buffer("video_patch_projection",
                                 torch.zeros(D, config.video_patch_dim))
        if config.summary_tokens:
            self.register_buffer("summary_idxs",
                                 torch.arange(config.summary_tokens, dtype=torch.long))
        if config.carried:
            self.carried = CarriedTensors(config.carried)

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, VisionBlock) and hasattr(m, "layer_scale1"):
                nn.init.ones_(m.layer_scale1)
                nn.init.ones_(m.layer_scale2)
        nn.init.normal_(self.pos_embed, std=std)
        nn.init.normal_(self.cls_token, std=std)
        if hasattr(self, "video_patch_projection"):
            nn.init.normal_(self.video_patch_projection, std=std)
        if hasattr(self, "summary_idxs"):
            self.summary_idxs.copy_(torch.arange(self.summary_idxs.numel()))

    def position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D]: the learned grid, bilinearly resized to ``h x w`` when it differs
        (``pos_interpolation: crop``: resized to ``max(h, w)`` square, then its top-left
        ``h x w`` kept, as RADIO)."""
        g = self.config.pos_grid
        crop = self.config.pos_interpolation == "crop"
        size = (max(h, w),) * 2 if crop else (h, w)
        if size == (g, g) and (h, w) == size:
            return self.pos_embed.view(g * g, -1)
        grid = self.pos_embed.view(1, g, g, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid.float(), size=size, mode="bilinear", align_corners=False)
        grid = grid[..., :h, :w]
        return grid.to(self.pos_embed.dtype)[0].permute(1, 2, 0).reshape(h * w, -1)

    def forward(self, pixel_values: torch.Tensor, image_grid: torch.Tensor) -> torch.Tensor:
        C = self.config.class_token_len
        grids = [tuple(g) for g in image_grid.tolist()]
        patches = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        pos = {g: self.position_embeddings(*g) for g in set(grids)}
        pieces, start = [], 0
        for g in grids:
            n = g[0] * g[1]
            pieces += [self.cls_token, patches[start:start + n] + pos[g]]
            start += n
        x = torch.cat(pieces) if pieces else patches[:0]
        cu = image_cu_seqlens(image_grid, extra=C)
        groups, unpermute = same_length_groups(cu.to(x.device))
        for block in self.blocks.values():
            x = block(x, groups, unpermute)
        if self.norm is not None:
            x = self.norm(x)
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        for s in cu[:-1].tolist():
            keep[s:s + C] = False
        return x[keep]


class CarriedTensors(nn.Module):
    """Frozen buffers named as a checkpoint's tensors (``{"a.b.w": [shape, dtype]}`` ->
    ``self.a.b.w``), saved with the model and never used: the parts of a checkpoint it does not
    model (an audio encoder) go through training into the export unchanged."""

    def __init__(self, tensors: dict):
        super().__init__()
        for name, (shape, dtype) in sorted(tensors.items()):
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_buffer(leaf, torch.zeros(shape, dtype=getattr(torch, dtype)))


def pixel_shuffle(x: torch.Tensor, image_grid: torch.Tensor, merge: int = 2) -> torch.Tensor:
    """[P_total, D] -> [P_total / merge^2, D * merge^2]: each image's ``merge x merge``
    neighbourhoods become one token (row-major over the merged grid)."""
    out, start = [], 0
    for h, w in image_grid.tolist():
        t = x[start:start + h * w].view(h // merge, merge, w // merge, merge, -1)
        out.append(t.permute(0, 2, 1, 3, 4).reshape((h // merge) * (w // merge), -1))
        start += h * w
    return torch.cat(out) if out else x.new_zeros(0, x.shape[-1] * merge * merge)


class Projector(nn.Module):
    """RMSNorm -> linear -> squared ReLU -> linear, from merged vision tokens to the LM width."""

    def __init__(self, config: NemotronVLMConfig):
        super().__init__()
        d_in = config.vision_config.hidden_size * config.merge ** 2
        eps = config.projector_norm_eps
        self.norm = RMSNorm(d_in, eps=config.text_config.layer_norm_epsilon if eps is None else eps)
        self.fc1 = nn.Linear(d_in, config.projector_hidden_size, bias=False)
        self.fc2 = nn.Linear(config.projector_hidden_size, config.text_config.hidden_size,
                             bias=False)

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        self.norm.reset_parameters()
        nn.init.normal_(self.fc1.weight, std=std)
        nn.init.normal_(self.fc2.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.square(F.relu(self.fc1(self.norm(x)))))
