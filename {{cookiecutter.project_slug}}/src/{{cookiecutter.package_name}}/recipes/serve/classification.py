"""An image classifier behind the server: an image file (base64) in, its top-k classes out."""

from __future__ import annotations

import base64
import binascii
import io
import threading
from typing import Any

import torch

from ...checkpointing.trained import Trained
from ...errors import ConfigError
from .batching import Batcher, Checked, Pending, Scheduler
from .errors import BadRequest, fields, whole_field
from .settings import Settings


class RequestImage(io.BytesIO):
    """An uploaded image file, named so in the data module's and Pillow's messages (never by its
    memory address)."""

    def __str__(self) -> str:
        return "the image"

    __repr__ = __str__


class Classification:
    """An image classifier: an image file in, its top-k classes out."""

    kind = "image"
    path = "/classify"

    def __init__(self, trained: Trained, settings: Settings, device: torch.device) -> None:
        self.model: Any = trained.model.to(device).eval()
        self.datamodule: Any = trained.datamodule
        self.device = device
        self.settings = settings
        names = getattr(self.datamodule, "classes", None)
        self.names = [str(name) for name in names] if isinstance(names, (list, tuple)) else None

    def parse(self, body: Any) -> Checked:
        body = fields(body, ("image",), ("top_k",))
        encoded = body["image"]
        if not isinstance(encoded, str):
            raise BadRequest("image must be a string: the image file in base64")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError) as error:
            raise BadRequest(f"image is not base64 ({error})") from error
        top_k = whole_field(body, "top_k", self.settings.top_k_classes, 1, None)
        from PIL.Image import DecompressionBombError

        from ...data.image_files import open_image  # vision bakes only hold it

        try:
            with open_image(RequestImage(data)) as opened:
                width, height = opened.size
        except DecompressionBombError as error:  # past twice Pillow's own pixel limit
            raise BadRequest(f"image is too large to decode ({error})", 413) from error
        except Exception as error:  # Pillow raises OSError, SyntaxError, ValueError, ...
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise BadRequest(
                f"image does not decode ({reason}): send a PNG or JPEG file"
            ) from error
        if width * height > self.settings.image_pixels:
            raise BadRequest(
                f"image is {width}x{height} pixels, more than this server's limit of "
                f"{self.settings.image_pixels}",
                413,
            )
        try:
            images = self.datamodule.images_from_files([RequestImage(data)])
        except ConfigError as error:
            raise BadRequest(f"image does not decode: {error}") from error
        return Checked(images, {"top_k": top_k})

    def scheduler(self, settings: Settings) -> Scheduler:
        return Batcher(self, settings)

    def groups(self, batch: list[Pending]) -> list[list[Pending]]:
        return [batch]

    def run(self, group: list[Pending], stopping: threading.Event) -> None:
        images = torch.cat([pending.inputs for pending in group]).to(self.device)
        labels = torch.full((len(group),), -1, device=self.device)
        batch = self.datamodule.on_after_batch_transfer((images, labels), 0)
        probabilities = self.model.predict_step(batch, 0).float().cpu()
        most = min(max(pending.options["top_k"] for pending in group), probabilities.size(1))
        top = probabilities.topk(most, dim=1)
        for pending, classes, chances in zip(
            group, top.indices.tolist(), top.values.tolist(), strict=True
        ):
            count = pending.options["top_k"]
            answer = [{"class": c, "probability": p} for c, p in zip(classes, chances, strict=True)]
            if self.names and len(self.names) == probabilities.size(1):
                for item in answer:
                    item["name"] = self.names[item["class"]]
            pending.send({"classes": answer[:count], "batch_size": len(group)})

    def info(self) -> dict[str, Any]:
        defaults = {"top_k": self.settings.top_k_classes}
        return {"batching": "batches", "batch_timeout": self.settings.batch_timeout,
                "defaults": defaults}  # fmt: skip
