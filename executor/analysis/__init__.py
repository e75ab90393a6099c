"""Computation analysis of a recipe (tools/op_analysis.py, `cann-recipes-infer analyze`).

Where a decode step's time goes and what will not map onto the NPU, in four parts:

- trace.py: the model's own regions (layer_i_attn, layer_i_mlp/moe, embed, final_norm,
  lm_head) as torch.profiler ranges; time per region and op type over several eager steps; per
  op call its FLOPs, bytes, dtype, model source line and the executor.ops entry it runs in;
- roofline.py: this machine's read bandwidth and matmul rate, and which ops are bandwidth-,
  compute- or overhead-bound;
- mapping.py (+ converters.py, run in a subprocess): the aten/custom ops of the decode graph as
  dynamo captures it, whether torchair (from the torch-npu wheel, as the GE conversion tier)
  has a GE converter for each, which fused torch_npu op our NPU table uses instead, graph
  breaks and host fallbacks, each with its model source line;
- findings.py + report.py: fusion, dtype and custom-op opportunities with an estimated saving
  per step, ranked so the first line is the biggest; markdown, JSON and a PNG.

Timings here are measured on the machine that runs the tool (on CPU: portable measurements, not
Ascend ones); the mapping is what torchair's converter says, not an NPU run.
"""
