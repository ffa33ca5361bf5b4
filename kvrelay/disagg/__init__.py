"""Prefill/decode disaggregation over HTTP.

    proxy.py     the P/D proxy (`kvrelay proxy`): prefill leg to P, decode leg to D
    launcher.py  a local cluster in one command (`kvrelay up`)
    demo.py      a guided look at a running cluster (`kvrelay demo`)

Nothing is imported here: the CLI loads `*_cli` modules, which must stay light.
"""
