"""Test support, imported as `tests.helpers.<module>` (pytest puts the repository root on
sys.path because tests/ is a package): keys and waits (`support`), worker processes
(`workers`), a served gateway and a module's fleet (`gateway`), a worker's fenced ticks
(`ticks`), events written as a worker would (`publish`), network faults (`proxies`),
one band's stats and one model's tenant usage (`reads`),
checkpoints (`models`, `gguf_files`). The redis-server the tests run is the package's
own launcher, `tokenfleet.local.RedisServer`."""
