"""Media: one module per medium, each giving what planning and gathering need of it.

A medium's module offers the metadata probe the Planner uses (headers only, no decode, counted so tests can
prove it), the decode at gather (once per delivery), its placeholder-token rule, its encoder cost and the
arrays its batch fields carry: `image` (with `image_policy`, the Qwen2-VL resize rule), `video` (with
`container_size`, the truncation check its probe adds) and `audio` (with `audio_features`, its log-mel).
`registry` names the kinds and what the rest of plait asks of each.

Audio, as the seam will call it:

    info = audio.probe(data, name)                  # planning: headers only (AUDIO_DECODES unchanged)
    plan = policy.plan(info)                        # windows, frames, placeholder tokens (plan.tokens)
    cost = audio.encoder_cost(plan, linear, quad)   # the encoder's share of the sample's cost
    feats = policy.load(data, info, name)           # gather: one decode, input_features + feature_attention_mask

A bad file raises base.MediaError naming it; the reader wraps it in a SourceError and applies its policy.

This package sits beside sources/transforms/state in the layers: it imports only the core below it (errors,
the spec sections, batch layouts), never roles, runtime or the face, so a reader or the balancer can take from it without a cycle.
"""
