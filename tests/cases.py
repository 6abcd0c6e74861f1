"""What the horovodrun workers run and the tests check (no imports: workers load it too)."""

#: compressors every worker runs through real Horovod
SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05",
         "threshold:threshold=1.0", "laplace_topk:density=0.05,exact=1", "rangefloat:bits=8",
         "topk:density=0.05,values=rangefloat8"]
#: the parameters of the workers' toy models
SHAPES = {"w": (12, 10), "b": (7,)}
#: the policy scenario: parameter -> (torch shape, keras shape, compressor)
POLICY = {"conv": ((8, 4, 3, 3), (3, 3, 4, 8), "kernel_select:fraction=0.25"),
          "fc": ((20, 30), (30, 20), "twobit"),
          "bias": ((5,), (5,), "none")}
