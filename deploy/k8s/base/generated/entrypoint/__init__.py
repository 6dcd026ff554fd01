"""The kit's vLLM containers' entrypoint: pick this replica's GPUs, read secrets, build the
--kv-transfer-config, run vLLM and turn its exit into the container's.

Compose runs it as `python3 /opt/pcp-pd-kit/entrypoint/vllm_serve` (the folder, __main__.py), the
Kubernetes pods the same from their ConfigMap. One module per concern:

    main.py             the steps in order
    gpus.py             the role's GPU list, each replica's slice, CUDA_VISIBLE_DEVICES
    replica.py          which replica this is (KIT_REPLICA_INDEX or Docker's DNS) and its GPUs
    slots.py            the slot lease that keeps replicas on disjoint GPUs (compose only)
    gpu_memory.py       the wait until those GPUs have the memory vLLM will ask for
    secret_files.py     the HF token and vLLM API key from files into vLLM's environment
    environment.py      vLLM's environment (side-channel host, devices, secrets)
    kv_config.py        --kv-transfer-config from the KIT_KV_* variables
    kv_events.py        --kv-events-config for pd-proxy's cache index
    tracing.py          --otlp-traces-endpoint, the protocol and this replica's service name
    cpu_topology.py     a CPU server's PCP/EP flags, cores and prefix-caching switch
    switches.py         the one on/off parser (ENFORCE_EAGER)
    command.py          the vLLM command line
    transport.py        the GPU servers' UCX settings and the watcher of UCX's tables
    ucx_tables.py       UCX's protocol tables, parsed
    transport_check.py  KV_TRANSPORT_CHECK: a NIXL READ at start (nixl_read_probe.py), judged
    supervise.py        vLLM as a child: stops passed on, exit status, network watch, relay
    crash_loop.py       the bound on unasked exits in a row
    stop_flag.py        a stop asked for while the entrypoint waits
    console.py          the entrypoint's own `vllm_serve:` lines

Standard library only at import, and Python 3.8 syntax: it runs with the image's own Python before
vLLM is imported, and preflight imports its rules (gpus, switches, transport) with a GPU host's
system python3. dnspython and the connector are imported inside the functions that need them.
"""
