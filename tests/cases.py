"""What the horovodrun workers run and the tests check (no imports: workers load it too)."""

#: compressors every worker runs through real Horovod
SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05",
         "threshold:threshold=1.0", "laplace_topk:density=0.05,exact=1", "rangefloat:bits=8",
         "topk:density=0.05,values=rangefloat8",
         # peer baselines (deterministic: a reference in numpy; qsgd/terngrad in BUCKET_SPECS)
         "signsgd", "onebit", "powersgd:rank=2"]
#: the parameters of the workers' toy models
SHAPES = {"w": (12, 10), "b": (7,)}
#: the policy scenario: parameter -> (torch shape, keras shape, compressor)
POLICY = {"conv": ((8, 4, 3, 3), (3, 3, 4, 8), "kernel_select:fraction=0.25"),
          "fc": ((20, 30), (30, 20), "twobit"),
          "bias": ((5,), (5,), "none")}

#: the bucket scenario: compressors whose bucketed aggregate must equal the tensor-by-tensor
#: one bit for bit, and the parameters (a 0-d one, one larger than the small bucket size)
BUCKET_SPECS = ["none", "fp16", "bf16", "topk:density=0.05", "randomk:density=0.05,seed=4",
                "threshold:threshold=1.0", "laplace_topk:density=0.05,exact=1",
                "topk:density=0.05,values=rangefloat8", "twobit", "rangefloat:bits=8",
                "dct:density=0.05,block=32",   # (kernel_select: in the policy, on "conv")
                "qsgd", "terngrad", "signsgd", "onebit", "powersgd:rank=2"]
BUCKET_TOL_SPECS = ["laplace_topk:density=0.05"]
#: PyTorch only (laplace_topk's fused search, and its padded payload): exact, and
#: tolerance mode
TORCH_BUCKET_SPECS = ["laplace_topk:density=0.05,exact=1,fused=1",
                      "laplace_topk:density=0.05,exact=1,padded=1",
                      "dct:density=0.05,block=32,padded=1"]
TORCH_BUCKET_TOL_SPECS = ["laplace_topk:density=0.05,fused=1",
                          "laplace_topk:density=0.05,padded=1,values=rangefloat8",
                          "laplace_topk:density=0.05,warm=1"]
BUCKET_SHAPES = {"conv": (6, 4, 3, 3), "big": (40, 30), "w": (12, 10), "b": (7,), "s": (),
                 "late": (5, 3)}
#: CUDA-graph replay through the optimizer (torch_worker's ``replay``; replayable specs)
REPLAY_SPECS = ["twobit", "laplace_topk:density=0.05,padded=1"]
#: bucket sizes compared: tensor by tensor (0), small (several buckets; "big" alone), default
BUCKET_MBS = [0, 0.002, 25]

#: aggregation-aware selection (agg=union/leader/hint): every density sparsifier, run
#: -np 2 and -np 3, tensor by tensor (0) and in one bucket (25), AGG_STEPS steps, op Sum
AGG_SPECS = ["topk:density=0.05,agg=union", "topk:density=0.05,agg=leader",
             "topk:density=0.05,agg=hint", "topk:density=0.05,agg=hint,beta=4,hint=union",
             "laplace_topk:density=0.05,agg=union", "dgc:density=0.05,agg=leader",
             "gaussian_k:density=0.05,agg=hint", "sidco_exp:density=0.05,agg=union",
             "randomk:density=0.05,agg=union", "dct:density=0.05,block=32,agg=union",
             "laplace_topk:density=0.05,ef=0,agg=leader"]
AGG_SHAPES = {"conv": (6, 4, 3, 3), "w": (12, 10), "b": (7,), "s": ()}
AGG_MBS = [0, 25]
AGG_STEPS = 4
#: on this step the leader's gradient is all zero (with ef=0 and laplace_topk it has
#: nothing to propose: the union is empty, yet no rank waits)
AGG_ZERO_STEP = 2

#: auto: three candidates, each calibrated once, tried one step each where close, decided,
#: then a check step every 2 steps
# drift=1000: a check step always decides again (it recalibrated, timing-dependent, when
# a loaded machine made the collectives 1.5x off the prediction: a flaky decision count)
AUTO_SPEC = ("auto:candidates=none|topk:density=0.1|fp16,calibrate=3,every=2,trial=1,"
             "drift=1000,verbose=0")
AUTO_CKPT_SPEC = "auto:candidates=none|topk:density=0.1,calibrate=2,every=0,trial=0,verbose=0"
AUTO_STEPS = 14
AUTO_MB = 0.002              #: several buckets ("big" alone)
