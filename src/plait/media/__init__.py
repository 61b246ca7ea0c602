"""Media: one module per medium, each giving what planning and gathering need of it.

A medium's module offers, as its `MEDIUM` (the `registry.Medium` interface, the same names for every
medium): `policy(spec)`, the metadata `probe` the Planner uses (headers only, no decode, counted so tests can
prove it), `plan`, the `decode` at gather (once per delivery), `placeholder_tokens(plan)`, `encoder_units(plan)`
(what plait.cost.EncoderCost.of_units, the one encoder formula, prices) and `batch_fields`: `image` (with
`image_policy`, the Qwen2-VL resize rule), `video` (with `container_size`, the truncation check its probe
adds) and `audio` (with `audio_features`, its log-mel). `registry` names the kinds; the rest of plait finds a
media's medium by `registry.kind_of(ref).medium`.

    medium = AUDIO.medium                                  # or kind_of(ref).medium
    policy = medium.policy(spec)                           # the spec's `audio` section
    plan = medium.plan(policy, medium.probe(data, name))   # planning: headers only (AUDIO_DECODES unchanged)
    tokens = medium.placeholder_tokens(plan)               # the placeholder run in input_ids
    units, squares = medium.encoder_units(plan)            # EncoderCost(...).of_units(units, squares)
    feats = medium.decode(data, plan, policy, name)        # gather: one decode

A bad file raises base.MediaError naming it; the reader wraps it in a SourceError and applies its policy.

This package sits beside sources/transforms/state in the layers: it imports only the core below it (errors,
the spec sections, batch layouts), never roles, runtime or the face, so a reader or the balancer can take from it without a cycle.
"""
