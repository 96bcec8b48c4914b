from benchmarks.cache_replicas.bench import main

main()
