"""``mrp-train ... --push-to-hub REPO_ID``: the exported model folder uploaded to the Hub with huggingface_hub, checked
before training starts (a repo id that cannot exist, no network, no login) so a run does not train for hours to fail
at its upload."""

from __future__ import annotations

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from .config import ConfigError

# what stays local: the resumable training checkpoints (optimizer states, several times the model's size)
LOCAL_ONLY = ["checkpoints/*"]


def check_push(repo_id: str) -> None:
    """Refuse a ``--push-to-hub`` that cannot succeed, before training: an invalid repo id, offline mode, no token, a
    token the Hub does not accept or a Hub it cannot reach."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ConfigError(f"--push-to-hub {repo_id!r} is not a Hub repo id ('owner/name'): {err}") from None
    if "/" not in repo_id:
        raise ConfigError(f"--push-to-hub {repo_id!r}: give the owner too ('your-name/{repo_id}')")
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"--push-to-hub {repo_id}: HF_HUB_OFFLINE is set, so nothing can be uploaded (unset it, "
                          "or drop --push-to-hub and upload the folder later with hf upload)")
    token = get_token()
    if token is None:
        raise ConfigError(f"--push-to-hub {repo_id}: no Hub token: log in first (hf auth login) or set HF_TOKEN")
    try:
        HfApi().whoami(token=token)
    except Exception as err:  # no network, or a token the Hub refuses (huggingface_hub's errors have no common base)
        raise ConfigError(f"--push-to-hub {repo_id}: the Hub did not confirm the login ({type(err).__name__}: {err}); "
                          "check the network and the token (hf auth whoami), or drop --push-to-hub and upload the "
                          "folder later with hf upload") from None


def push(out_dir: str, repo_id: str, private: bool, message: str) -> str:
    """Upload the model folder ``out_dir`` (not its checkpoints) to ``repo_id``, creating the repo (``private``) if
    it does not exist, in one commit with ``message``. Returns the commit's URL. A failed upload raises ConfigError
    saying where the model is and how to upload it by hand."""
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo_id, folder_path=out_dir, ignore_patterns=LOCAL_ONLY,
                                   commit_message=message, repo_type="model")
    except Exception as err:  # network, permission, quota: the trained model is safe on disk either way
        raise ConfigError(f"--push-to-hub {repo_id}: the upload failed ({type(err).__name__}: {err}); the model is "
                          f"saved in {out_dir}: upload it with hf upload {repo_id} {out_dir} . --exclude "
                          f"'{LOCAL_ONLY[0]}'") from err
    return str(getattr(commit, "commit_url", commit))
