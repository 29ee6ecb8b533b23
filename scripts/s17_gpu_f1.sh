#!/usr/bin/env bash
# session 17 device call F1: park the first part of the SmolLM2 GGUF in /tmp (call F2 follows at once)
cp .gguf/smol.part-aa /tmp/ && ls -la /tmp/smol.part-aa
