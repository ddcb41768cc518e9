"""What the tests share: servers on loopback, Redis, corpora, waiting, fakes that inject failures."""
