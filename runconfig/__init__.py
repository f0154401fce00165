"""The run configuration: one JSON per run, its blocks typed and checked before anything is built. It sits below
everything that reads it (the planner, training, the tools, the lab) and imports only the model's configuration,
data's constants and, for ``model.from_hf`` and the end-of-text token, hf/'s readers.

    module                    holds
    runconfig/run.py          RunConfig: the JSON's blocks and DeepSpeed's own keys, parse_run_config,
                              load_run_config (--set overrides), the defaults resolved from the tokenizer and the run
    runconfig/blocks.py       the schedule, data and training blocks
    runconfig/monitors.py     the training blocks of the monitors and guards: profile, wandb, spike_guard,
                              memory_snapshot
    runconfig/schedules.py    the schedules' arithmetic in tokens: the learning rate, the batch ramp, the batch from the
                              gradient noise scale
    runconfig/fields.py       --set overrides, a block's dict into its dataclass, the type check that names the field

A check that needs code of a higher layer (the planner's GPU presets for training.plan_hardware, DeepSpeed and the
datasets) runs where training starts (training/run.py), not here.
"""
