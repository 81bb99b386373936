from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.urls import path

from web import views
from web.forms import LoginForm, NewPasswordForm

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("signup/", views.signup, name="signup"),
    path("verify/resend/", views.verify_resend, name="verify_resend"),
    path("downloads/<str:filename>", views.mahout_download, name="mahout_download"),
    path("verify/<str:token>/", views.verify_email, name="verify_email"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="web/login.html", authentication_form=LoginForm, redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password-reset/", views.password_reset, name="password_reset"),  # Django's, its e-mails rate-limited
    path(
        "password-reset/sent/",
        auth_views.PasswordResetDoneView.as_view(template_name="web/password_reset_done.html"),
        name="password_reset_done",
    ),
    path(
        "password-reset/<uidb64>/<token>/",
        auth_views.PasswordResetConfirmView.as_view(
            template_name="web/password_reset_confirm.html", form_class=NewPasswordForm
        ),
        name="password_reset_confirm",
    ),
    path(
        "password-reset/done/",
        auth_views.PasswordResetCompleteView.as_view(template_name="web/password_reset_complete.html"),
        name="password_reset_complete",
    ),
    path("topup/", views.topup, name="topup"),
    path("keys/", views.keys, name="keys"),
    path("keys/<id:key_id>/revoke/", views.key_revoke, name="key_revoke"),
    path("usage/", views.usage, name="usage"),
    path("usage/csv/", views.usage_csv, name="usage_csv"),
    path("models/", views.catalog, name="catalog"),
    path("quickstart/", views.quickstart, name="quickstart"),
    path("machines/", views.machines, name="machines"),
    path("machines/status.json", views.machines_status, name="machines_status"),
    path("machines/<id:host_id>/", views.machine_detail, name="machine_detail"),
    path("machines/<id:host_id>/payout/", views.machine_payout, name="machine_payout"),
    path("machines/<id:host_id>/payout/setup/", views.machine_payout_setup, name="machine_payout_setup"),
    path("machines/<id:host_id>/payout/return/", views.machine_payout_return, name="machine_payout_return"),
    path("machines/<id:host_id>/resume/", views.machine_resume, name="machine_resume"),
    path("machines/<id:host_id>/token/", views.machine_token_rotate, name="machine_token_rotate"),
    path("pool/", views.pool, name="pool"),
]
