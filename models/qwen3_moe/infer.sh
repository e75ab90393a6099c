#!/usr/bin/env bash
# `cd models/<recipe>; bash infer.sh [--yaml NAME] [--set key=value ...]`: run this recipe (default: config/builtin.yaml).
DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$DIR/../../infer.sh" --model "$(basename "$DIR")" "$@"
