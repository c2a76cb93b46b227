"""Export to and import from HF ``transformers``: BERT, GPT-2, Llama and T5.

``export_hf(checkpoint, out_dir)`` writes a directory that ``AutoModelFor*.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load; ``import_hf(hf_dir, out_dir)`` writes a tformer run
directory to continue pretraining from. Each target is one short module holding its config
checks and its name map (``Rule``: HF tensor <- our tensors).
"""

from .common import ExportError, read_model_state
from .hf import TARGETS, export_hf, import_hf, to_hf_model

__all__ = ["ExportError", "TARGETS", "export_hf", "import_hf", "read_model_state", "to_hf_model"]
