"""Hugging Face interop: a checkpoint of this project <-> a ``transformers`` causal LM, one layer at a time.

    module               what
    tables               the tensor table of each architecture (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral,
                         Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), layer maps, shapes
    transforms           the named transforms: merge TP shards into an HF tensor, split one into shards
    config_map           HF config.json <-> the model block: the fields it fixes, the options refused
    checkpoint_reader    open a checkpoint of this project and read it a layer at a time, checked
    safetensors_writer   safetensors files written a tensor at a time (headers planned up front), sharded
    tokenizer            the tokenizer that travels with a model (GPT-2's, or an HF directory's)
    files                staging beside the output and an atomic rename; progress bars
    export               checkpoint -> HF directory (tools/convert_to_hf.py)
    importer             HF directory -> checkpoint at any TP x PP (tools/convert_from_hf.py); block-scaled fp8
                         weights dequantised as they are read

The checkpoint file names are model/checkpoint_files.py's (training writes them, conversion and reshape read them).
Nothing here imports training/: the run config's model block arrives as a ModelConfig.
"""

from hf.config_map import check_model_matches, model_fields_from_hf, read_hf_config
from hf.export import DEFAULT_MAX_SHARD_SIZE, export_to_hf
from hf.importer import IMPORT_RECORD, import_from_hf, read_import_record
from hf.tables import ARCHITECTURES, PRECISION_DTYPES

__all__ = ["ARCHITECTURES", "DEFAULT_MAX_SHARD_SIZE", "IMPORT_RECORD", "PRECISION_DTYPES", "check_model_matches",
           "export_to_hf", "import_from_hf", "model_fields_from_hf", "read_hf_config", "read_import_record"]
