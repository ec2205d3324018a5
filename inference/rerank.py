"""Optional CLIP re-ranking: score sampled images by image-text similarity and keep the best.

DALL-E drew many samples per prompt and kept the ones CLIP liked best. The CLIP here is an
open_clip model whose weights are already on disk; nothing is downloaded:

    --rerank-clip ViT-B-32:/models/clip-vit-b-32.pt      an open_clip architecture + a weights file
    --rerank-clip local-dir:/models/my-clip              a folder with open_clip_config.json and weights
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image

from pipeline.core.errors import UserError

LOCAL_DIR = "local-dir:"
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pth")  # what open_clip looks for in a local-dir folder


class RerankError(UserError):
    pass


def parse_clip_spec(spec: str) -> tuple[str, str | None]:
    """`MODEL:WEIGHTS` or `local-dir:FOLDER` -> (open_clip model name, weights file or None)."""
    if spec.startswith(LOCAL_DIR):
        folder = Path(spec.removeprefix(LOCAL_DIR))
        if not (folder / "open_clip_config.json").is_file():
            raise RerankError(f"--rerank-clip {spec}: {folder} has no open_clip_config.json")
        if not any(folder.glob(pattern) for pattern in WEIGHT_FILES):
            raise RerankError(f"--rerank-clip {spec}: {folder} holds no weights ({', '.join(WEIGHT_FILES)})")
        return spec, None
    name, separator, weights = spec.partition(":")
    if not separator or not name or not weights:
        raise RerankError(
            f"--rerank-clip {spec!r} is not MODEL:WEIGHTS (e.g. ViT-B-32:/models/clip.pt) or local-dir:FOLDER"
        )
    if name.startswith("hf-hub"):
        raise RerankError("--rerank-clip does not download weights; pass MODEL:WEIGHTS or local-dir:FOLDER")
    if not Path(weights).is_file():
        raise RerankError(f"--rerank-clip: the CLIP weights {weights} do not exist")
    return name, weights


class ClipReranker:
    def __init__(self, spec: str, device: torch.device | str = "cpu") -> None:
        try:
            import open_clip
        except ImportError:
            raise RerankError("--rerank-clip needs open_clip: pip install 'ttt[rerank]'") from None
        name, weights = parse_clip_spec(spec)
        if weights is not None and name not in open_clip.list_models():
            raise RerankError(f"--rerank-clip: {name!r} is not an open_clip architecture (see open_clip.list_models())")
        try:
            model, _, self.preprocess = open_clip.create_model_and_transforms(name, pretrained=weights, device=device)
            self.tokenizer = open_clip.get_tokenizer(name)
        except Exception as err:  # open_clip raises RuntimeError/ValueError/OSError for unusable weights
            raise RerankError(f"--rerank-clip {spec}: cannot load the CLIP model: {str(err).splitlines()[0]}") from None
        self.model = model.eval()
        self.device = torch.device(device)

    @torch.no_grad()
    def scores(self, images: list[Image.Image], prompt: str) -> torch.Tensor:
        """Cosine similarity between each image and the prompt, [len(images)]."""
        pixels = torch.stack([self.preprocess(image) for image in images]).to(self.device)
        image_features = self.model.encode_image(pixels).float()
        text_features = self.model.encode_text(self.tokenizer([prompt]).to(self.device)).float()
        image_features = image_features / image_features.norm(dim=-1, keepdim=True)
        text_features = text_features / text_features.norm(dim=-1, keepdim=True)
        return (image_features @ text_features.T).squeeze(1).cpu()
