"""`isoserve bench`: load any OpenAI-compatible server, or compare the offline engine with its peers.

    main.py        the command's options and which mode runs
    http_mode.py   HTTP mode: calibrate prompts, run each load setting, report
    workload.py    seeded synthetic requests (fixed or ShareGPT-like lengths)
    calibrate.py   how many tokens a server makes of our prompt words
    client.py      one streamed completion, timed token by token
    load.py        closed-loop (concurrency) and open-loop (Poisson) drivers
    stats.py       percentiles and the per-setting summary
    report.py      the printed table and the JSON file
    plot.py        throughput and latency percentiles as a PNG
    offline.py     LLM.generate against transformers in one process (peers.py)
    prefill.py     one long prompt's processing: isoserve, transformers, llama-server
    roofline.py    measured FLOP/s and memory bandwidth, the ideal decode step, isoserve's step
    llama_server.py  llama.cpp's llama-server as a peer (built by bench/build_llama_server.sh)
    local_server.py, prom.py, zmq_raw.py, machine.py, docfile.py: for bench/run_benchmarks.py

Nothing here asserts on timings: it measures and reports.
"""
