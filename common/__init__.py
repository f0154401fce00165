"""The floor every package stands on: what all of them share and nothing of the model or the run.

- ``common.deepspeed_internals``: the one door to DeepSpeed's private API, checked against the supported versions.
- ``common.device``: where a run-time tensor is made: on the device of the module it meets, or on the host by design.
- ``common.files``: atomic writes (temporary name, fsync, rename, directory fsync).
- ``common.net``: ``free_port``, for every launcher and test that needs a rendezvous port.
- ``common.dtypes``: the precision names (fp32, bf16, fp16), their torch dtypes and bytes per element.
"""
