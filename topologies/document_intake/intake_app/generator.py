"""Synthetic identity cards and business licences with their ground truth, rendered with a CJK font.

Every document is a deterministic function of its seed: an identity (name, sex, ethnicity, birth
date, address in a real administrative division, an 18-digit identity number with its ISO 7064 check
character, a validity period) or a company (name, unified social credit code with both its check
characters, legal representative, dates, address), drawn with the WenQuanYi Micro Hei font of
Debian's ``fonts-wqy-microhei`` package, then photographed badly: sensor noise, blur, a tilt, low
light, upside down, JPEG compression. Some documents are expired, some forged (the last character of
the code is wrong), and the ground truth says which and what the clerk's decision should be.

A card is a single synthetic face carrying the front's fields and the back's validity period; the
layouts follow the real documents' order of fields, not their artwork.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from intake_app.codes import USCC_ALPHABET, id_check_char, uscc_check_char, uscc_with_checks

#: Where Debian's CJK fonts put the face this generator draws with (``make system-deps`` installs it).
FONT_CANDIDATES = (
    Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc"),
    Path("/usr/share/fonts/truetype/wqy/wqy-zenhei.ttc"),
)

SURNAMES = "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔钟谭陆汪范金石廖贾夏韦付方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤"
GIVEN = "伟芳娜秀英敏静丽强磊军洋勇艳杰娟涛明超秀兰霞平刚桂英华建国建华志强永红海燕玉兰文斌晓东晓红丹宇鹏飞欣怡子涵浩然梓轩雨桐思远佳怡俊杰嘉豪宏伟春梅秋菊冬雪立新德胜振华国庆"
ETHNICITIES = ("汉",) * 17 + ("回", "满", "壮", "蒙古", "苗", "土家", "维吾尔", "藏")
#: Real county-level divisions: code, province, city, district, and roads of the place.
DIVISIONS = (
    ("110105", "北京市", "", "朝阳区", ("建国路", "朝阳北路", "望京街", "酒仙桥路")),
    ("310104", "上海市", "", "徐汇区", ("漕溪北路", "宜山路", "天钥桥路", "龙华中路")),
    ("440305", "广东省", "深圳市", "南山区", ("科技园路", "深南大道", "后海大道", "南海大道")),
    ("330106", "浙江省", "杭州市", "西湖区", ("文三路", "天目山路", "古墩路", "紫荆花路")),
    ("510107", "四川省", "成都市", "武侯区", ("人民南路", "科华北路", "武侯祠大街", "红牌楼路")),
    ("420106", "湖北省", "武汉市", "武昌区", ("中北路", "友谊大道", "武珞路", "和平大道")),
    ("320102", "江苏省", "南京市", "玄武区", ("中山路", "珠江路", "北京东路", "龙蟠路")),
    ("350102", "福建省", "福州市", "鼓楼区", ("五四路", "湖东路", "杨桥中路", "东街")),
)
COMPANY_WORDS = ("云帆", "星河", "恒信", "博远", "华泰", "瑞达", "鼎盛", "启明", "东方", "长青", "海纳", "金石", "卓越", "远景")
COMPANY_TRADES = ("科技", "贸易", "信息技术", "物流", "餐饮管理", "建筑工程", "文化传媒", "医疗器械", "电子商务")
COMPANY_TYPES = ("有限责任公司（自然人投资或控股）", "有限责任公司（自然人独资）", "股份有限公司（非上市）")
CAPITALS = ("壹佰万元整", "伍佰万元整", "壹仟万元整", "叁佰万元整", "贰佰万元整", "伍拾万元整")

#: What the generator makes of a run: the share of each kind and of each flaw.
KIND_SHARES = {"id_card": 0.6, "business_licence": 0.4}


@dataclass(frozen=True)
class Conditions:
    """How a document was photographed."""

    noise: float = 0.0  # standard deviation of additive sensor noise, in grey levels
    blur: float = 0.0  # Gaussian blur radius, pixels
    tilt: float = 0.0  # rotation, degrees (counter-clockwise)
    light: float = 1.0  # brightness factor (< 1: low light)
    upside_down: bool = False
    jpeg_quality: int | None = None  # JPEG at this quality; None: PNG

    def describe(self) -> str:
        parts = [f"noise {self.noise:.0f}" if self.noise else "", f"blur {self.blur:.1f}" if self.blur else "",
                 f"tilt {self.tilt:+.1f}°" if self.tilt else "", f"light {self.light:.2f}" if self.light < 1 else "",
                 "upside down" if self.upside_down else "", f"jpeg q{self.jpeg_quality}" if self.jpeg_quality else "png"]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class Document:
    """One rendered document and its ground truth."""

    doc_id: str
    doc_type: str  # id_card | business_licence
    fields: dict[str, str]  # what a perfect reader extracts (dates as YYYY-MM-DD)
    forged: bool
    expired: bool
    conditions: Conditions
    image: bytes = field(repr=False)  # the encoded file (PNG or JPEG)

    @property
    def expected_action(self) -> str:
        """The clerk's decision: a forged or expired document is rejected, any other approved."""
        return "reject" if self.forged or self.expired else "approve"

    @property
    def content_type(self) -> str:
        return "image/jpeg" if self.conditions.jpeg_quality else "image/png"


def font_path() -> Path:
    for path in FONT_CANDIDATES:
        if path.is_file():
            return path
    raise FileNotFoundError("no CJK font: install Debian's fonts-wqy-microhei (`make system-deps` does)")


class _Fonts:
    """The font at the sizes the layouts use, loaded once per process."""

    _cache: dict[int, ImageFont.FreeTypeFont] = {}

    @classmethod
    def get(cls, size: int) -> ImageFont.FreeTypeFont:
        if size not in cls._cache:
            cls._cache[size] = ImageFont.truetype(str(font_path()), size)
        return cls._cache[size]


def _cn_date(d: date) -> str:
    return f"{d.year}年{d.month}月{d.day}日"


def _cn_date_padded(d: date) -> str:
    return f"{d.year}年{d.month:02d}月{d.day:02d}日"


def _dotted(d: date) -> str:
    return f"{d.year}.{d.month:02d}.{d.day:02d}"


def _add_years(d: date, years: int) -> date:
    try:
        return d.replace(year=d.year + years)
    except ValueError:  # 29 February
        return d.replace(year=d.year + years, day=28)


class Generator:
    """Documents of a seeded run: ``document(i)`` is the same document for the same seed and index."""

    def __init__(self, seed: int, *, today: date | None = None, forged_share: float = 0.12,
                 expired_share: float = 0.12, hard_share: float = 0.5):
        self.seed = seed
        self.today = today or date.today()
        self.forged_share = forged_share
        self.expired_share = expired_share
        self.hard_share = hard_share

    def document(self, index: int, *, kind: str | None = None, forged: bool | None = None,
                 expired: bool | None = None, conditions: Conditions | None = None) -> Document:
        rng = random.Random(f"{self.seed}:{index}")
        kind = kind or rng.choices(list(KIND_SHARES), weights=list(KIND_SHARES.values()))[0]
        draw = rng.random()
        forged = draw < self.forged_share if forged is None else forged
        expired = (self.forged_share <= draw < self.forged_share + self.expired_share) if expired is None else expired
        conditions = conditions or self.conditions(rng)
        doc_id = f"doc-{self.seed}-{index:06d}"
        if kind == "id_card":
            fields, image = self._id_card(rng, forged, expired)
        elif kind == "business_licence":
            fields, image = self._licence(rng, forged, expired)
        else:
            raise ValueError(f"unknown document kind {kind!r}")
        return Document(doc_id, kind, fields, forged, expired, conditions, photograph(image, conditions, rng))

    def conditions(self, rng: random.Random) -> Conditions:
        """Half of the documents are photographed well; the rest with one or two flaws."""
        quality = rng.choice((None, None, 92, 80))
        if rng.random() >= self.hard_share:
            return Conditions(jpeg_quality=quality)
        flaws = rng.sample(("noise", "blur", "tilt", "light", "upside_down"), k=rng.choice((1, 1, 2)))
        return Conditions(
            noise=rng.uniform(6, 14) if "noise" in flaws else 0.0,
            blur=rng.uniform(0.6, 1.2) if "blur" in flaws else 0.0,
            tilt=rng.uniform(-4, 4) if "tilt" in flaws else 0.0,
            light=rng.uniform(0.35, 0.6) if "light" in flaws else 1.0,
            upside_down="upside_down" in flaws,
            jpeg_quality=quality,
        )

    # -- identity cards ------------------------------------------------------------------------
    def identity(self, rng: random.Random, forged: bool, expired: bool) -> dict[str, str]:
        code, province, city, district, roads = rng.choice(DIVISIONS)
        sex = rng.choice(("男", "女"))
        birth = date(1950, 1, 1) + timedelta(days=rng.randrange(0, 365 * 55))
        sequence = rng.randrange(0, 500) * 2 + (1 if sex == "男" else 0)
        first17 = f"{code}{birth:%Y%m%d}{sequence:03d}"
        check = id_check_char(first17)
        if forged:
            check = rng.choice([c for c in "0123456789X" if c != check])
        years = 10 if birth.year > 1980 else 20
        if expired:
            valid_until = self.today - timedelta(days=rng.randrange(30, 2000))
        else:
            valid_until = self.today + timedelta(days=rng.randrange(60, 3650))
        valid_from = _add_years(valid_until, -years)
        given = "".join(rng.sample(GIVEN, rng.choice((1, 2))))
        address = f"{province}{city}{district}{rng.choice(roads)}{rng.randrange(1, 300)}号"
        if rng.random() < 0.5:
            address += f"{rng.randrange(1, 30)}栋{rng.randrange(1, 6)}单元{rng.randrange(101, 2800)}室"
        return {"name": rng.choice(SURNAMES) + given, "sex": sex, "ethnicity": rng.choice(ETHNICITIES),
                "birth_date": birth.isoformat(), "address": address, "id_number": first17 + check,
                "valid_from": valid_from.isoformat(), "valid_until": valid_until.isoformat()}

    def _id_card(self, rng: random.Random, forged: bool, expired: bool) -> tuple[dict[str, str], Image.Image]:
        f = self.identity(rng, forged, expired)
        width, height = 856, 540
        card = _paper(width, height, (236, 240, 243), (214, 226, 236), rng)
        d = ImageDraw.Draw(card)
        label, value = _Fonts.get(26), _Fonts.get(30)
        blue, black = (60, 110, 170), (20, 20, 20)
        d.text((50, 48), "姓名", font=label, fill=blue)
        d.text((140, 44), f["name"], font=value, fill=black)
        d.text((50, 108), "性别", font=label, fill=blue)
        d.text((140, 104), f["sex"], font=value, fill=black)
        d.text((240, 108), "民族", font=label, fill=blue)
        d.text((330, 104), f["ethnicity"], font=value, fill=black)
        birth = date.fromisoformat(f["birth_date"])
        d.text((50, 168), "出生", font=label, fill=blue)
        d.text((140, 164), _cn_date(birth), font=value, fill=black)
        d.text((50, 228), "住址", font=label, fill=blue)
        for i, line in enumerate(_wrap(f["address"], 13)):
            d.text((140, 224 + 46 * i), line, font=value, fill=black)
        d.text((50, 400), "公民身份号码", font=label, fill=blue)
        d.text((250, 396), f["id_number"], font=_Fonts.get(32), fill=black)
        d.text((50, 462), "有效期限", font=label, fill=blue)
        valid = f"{_dotted(date.fromisoformat(f['valid_from']))}-{_dotted(date.fromisoformat(f['valid_until']))}"
        d.text((200, 458), valid, font=value, fill=black)
        _portrait(card, (610, 60, 800, 300), rng)
        return f, card

    # -- business licences -----------------------------------------------------------------------
    def company(self, rng: random.Random, forged: bool, expired: bool) -> dict[str, str]:
        code, province, city, district, roads = rng.choice(DIVISIONS)
        organisation = "".join(rng.choice(USCC_ALPHABET) for _ in range(8))
        uscc = uscc_with_checks("9" + rng.choice("123"), code, organisation)
        if forged:
            uscc = uscc[:17] + rng.choice([c for c in USCC_ALPHABET if c != uscc_check_char(uscc[:17])])
        established = date(2000, 1, 1) + timedelta(days=rng.randrange(0, 365 * 20))
        if expired:
            until = self.today - timedelta(days=rng.randrange(30, 1500))
        elif rng.random() < 0.3:
            until = None  # 长期: no end
        else:
            until = self.today + timedelta(days=rng.randrange(60, 3650))
        place = (city or province).removesuffix("市").removesuffix("省")
        name = f"{place}{rng.choice(COMPANY_WORDS)}{rng.choice(COMPANY_TRADES)}有限公司"
        address = f"{province}{city}{district}{rng.choice(roads)}{rng.randrange(1, 300)}号"
        return {"uscc": uscc, "company_name": name, "company_type": rng.choice(COMPANY_TYPES),
                "legal_representative": rng.choice(SURNAMES) + "".join(rng.sample(GIVEN, rng.choice((1, 2)))),
                "registered_capital": rng.choice(CAPITALS), "established": established.isoformat(),
                "valid_until": until.isoformat() if until else "长期", "address": address}

    def _licence(self, rng: random.Random, forged: bool, expired: bool) -> tuple[dict[str, str], Image.Image]:
        f = self.company(rng, forged, expired)
        width, height = 1000, 700
        page = _paper(width, height, (250, 247, 240), (240, 232, 215), rng)
        d = ImageDraw.Draw(page)
        d.rectangle((14, 14, width - 15, height - 15), outline=(170, 120, 60), width=6)
        d.text((360, 40), "营业执照", font=_Fonts.get(62), fill=(150, 30, 30))
        label, value, black = _Fonts.get(26), _Fonts.get(28), (20, 20, 20)
        d.text((60, 150), "统一社会信用代码", font=label, fill=black)
        d.text((300, 147), f["uscc"], font=value, fill=black)
        established = date.fromisoformat(f["established"])
        term = "长期" if f["valid_until"] == "长期" else _cn_date_padded(date.fromisoformat(f["valid_until"]))
        rows = (("名称", f["company_name"]), ("类型", f["company_type"]), ("法定代表人", f["legal_representative"]),
                ("注册资本", f["registered_capital"]), ("成立日期", _cn_date_padded(established)),
                ("营业期限", f"{_cn_date_padded(established)}至{term}"), ("住所", f["address"]))
        for i, (name, text) in enumerate(rows):
            y = 215 + 62 * i
            d.text((60, y), name, font=label, fill=black)
            d.text((230, y - 3), text, font=value, fill=black)
        _seal(page, (760, 500, 930, 670))
        return f, page


def _wrap(text: str, width: int) -> list[str]:
    return [text[i:i + width] for i in range(0, len(text), width)]


def _paper(width: int, height: int, top: tuple[int, int, int], bottom: tuple[int, int, int],
           rng: random.Random) -> Image.Image:
    """A background with a vertical tint gradient and a faint guilloche-like wave pattern."""
    t = np.linspace(0.0, 1.0, height)[:, None, None]
    base = (1 - t) * np.array(top, float) + t * np.array(bottom, float)
    x = np.arange(width)[None, :, None]
    y = np.arange(height)[:, None, None]
    phase = rng.uniform(0, 6.28)
    wave = 4.0 * np.sin(x / 23.0 + 3.0 * np.sin(y / 41.0 + phase))
    return Image.fromarray(np.clip(base + wave, 0, 255).astype(np.uint8), "RGB")


def _portrait(card: Image.Image, box: tuple[int, int, int, int], rng: random.Random) -> None:
    """A stand-in for the holder's photograph: a head and shoulders in the person's own colours."""
    d = ImageDraw.Draw(card)
    x0, y0, x1, y1 = box
    d.rectangle(box, fill=tuple(rng.randrange(180, 240) for _ in range(3)))
    cx, w = (x0 + x1) // 2, x1 - x0
    skin = (rng.randrange(190, 235), rng.randrange(150, 200), rng.randrange(120, 170))
    d.ellipse((cx - w * 0.28, y0 + 30, cx + w * 0.28, y0 + 30 + w * 0.7), fill=skin)
    d.pieslice((x0 + 5, y1 - 90, x1 - 5, y1 + 90), 180, 360, fill=tuple(rng.randrange(20, 120) for _ in range(3)))
    hair = tuple(rng.randrange(10, 70) for _ in range(3))
    d.chord((cx - w * 0.3, y0 + 20, cx + w * 0.3, y0 + 20 + w * 0.45), 180, 360, fill=hair)


def _seal(page: Image.Image, box: tuple[int, int, int, int]) -> None:
    """The registration authority's red seal: a ring and a star."""
    d = ImageDraw.Draw(page)
    red = (200, 40, 40)
    d.ellipse(box, outline=red, width=6)
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    r = (box[2] - box[0]) * 0.18
    points = [(cx + r * np.cos(np.pi / 2 + k * 4 * np.pi / 5), cy - r * np.sin(np.pi / 2 + k * 4 * np.pi / 5))
              for k in range(5)]
    d.polygon(points, fill=red)


def photograph(image: Image.Image, c: Conditions, rng: random.Random) -> bytes:
    """The document as a phone or a scanner at the counter would capture it, encoded."""
    if c.tilt:
        image = image.rotate(c.tilt, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(128, 128, 128))
    if c.upside_down:
        image = image.rotate(180)
    if c.blur:
        image = image.filter(ImageFilter.GaussianBlur(c.blur))
    pixels = np.asarray(image, dtype=np.float32)
    if c.light < 1.0:
        pixels = 255.0 * (pixels / 255.0) ** 1.2 * c.light
    if c.noise:
        pixels = pixels + np.random.default_rng(rng.randrange(2**32)).normal(0.0, c.noise, pixels.shape)
    out = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    buffer = io.BytesIO()
    if c.jpeg_quality:
        out.save(buffer, "JPEG", quality=c.jpeg_quality)
    else:
        out.save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()
