"""Command-line tools around trained checkpoints, one module each (`python -m tools.<name> --help`):

  consolidate      one full fp32 state dict from a checkpoint of any layout
  export           a Hugging Face model folder (Llama, or the bundled modeling file)
  import_hf        a local Hugging Face Llama as a training checkpoint
  generate         sample text from a checkpoint
  evaluate         validation loss and perplexity on any shard set
  sink_report      attention-sink table and heatmap of a checkpoint
  convert_lisa     turn redundant attention layers into LISA layers
  convert_experts  one EP-independent state dict of a MoE/UoE checkpoint
  matching         the matched UoE / MoE / dense size presets and their configs
"""
