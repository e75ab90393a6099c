#!/usr/bin/env bash
# `cd models/qwen; bash infer.sh [--set key=value ...]`: run this recipe with its own config.yaml.
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$DIR/../../infer.sh" --model "$(basename "$DIR")" "$@"
