# evalplane's stand-in for conda's shell integration (there is no conda here), in the official layout:
# sourced from /opt/miniconda3/bin/activate and /root/.bashrc, it defines the `conda` shell function whose
# `activate NAME` activates the venv at <root>/envs/NAME. <root> is found from this file's own path, so the
# same files serve an instance image (/opt/miniconda3) and a process-backend environment (any directory).
_EP_CONDA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]:-/opt/miniconda3/etc/profile.d/conda.sh}")/../.." && pwd)"
export CONDA_EXE="$_EP_CONDA_ROOT/bin/conda"
export CONDA_SHLVL="${CONDA_SHLVL:-0}"

conda() {
    case "${1:-}" in
        activate)
            local name="${2:-base}"
            if [ "$name" = base ]; then
                if declare -F deactivate >/dev/null; then deactivate; fi
                case ":$PATH:" in *":$_EP_CONDA_ROOT/bin:"*) ;; *) export PATH="$_EP_CONDA_ROOT/bin:$PATH" ;; esac
                export CONDA_PREFIX="$_EP_CONDA_ROOT" CONDA_DEFAULT_ENV=base CONDA_SHLVL=1
                return 0
            fi
            if [ ! -f "$_EP_CONDA_ROOT/envs/$name/bin/activate" ]; then
                echo "EnvironmentNameNotFound: Could not find conda environment: $name" >&2
                return 1
            fi
            . "$_EP_CONDA_ROOT/envs/$name/bin/activate"
            export CONDA_PREFIX="$_EP_CONDA_ROOT/envs/$name" CONDA_DEFAULT_ENV="$name" CONDA_SHLVL=2
            ;;
        deactivate)
            if declare -F deactivate >/dev/null; then deactivate; fi
            export CONDA_PREFIX="$_EP_CONDA_ROOT" CONDA_DEFAULT_ENV=base CONDA_SHLVL=1
            ;;
        *) "$CONDA_EXE" "$@" ;;
    esac
}
